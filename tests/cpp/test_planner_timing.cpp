// The link estimate GradSync's timing plans read, and the priority tail
// (buckets held past the end of backward, then sent first layers first),
// single process: pure logic. The order predictor and bucket planner:
// test_planner.cpp.
#include <gtest/gtest.h>

#include <vector>

#include "hooks/bucket_planner.h"
#include "hooks/link_estimate.h"

namespace {

using ddpx::hooks::BucketPlan;

// The per-reduction cost is the least recent round trip (skew only adds);
// the rate counts each bucket's time less that cost.
TEST(LinkEstimate, LaunchCostIsTheLeastRecentRoundTripAndRateExcludesIt) {
  ddpx::hooks::LinkEstimate fit;
  EXPECT_EQ(fit.bytes_per_us(), 0);
  EXPECT_DOUBLE_EQ(fit.launch_us(), ddpx::hooks::LinkEstimate::kDefaultLaunchUs);
  for (double us : {900.0, 250.0, 4000.0, 300.0}) fit.add_round_trip(us);
  EXPECT_DOUBLE_EQ(fit.launch_us(), 250);
  // 250 us + 100 bytes/us per bucket; an empty bucket is ignored.
  fit.add_step({{1e5, 1250}, {1e6, 10250}, {0, 40}});
  EXPECT_NEAR(fit.bytes_per_us(), 100, 1e-9);
  // Only the last 8 round trips count.
  for (int i = 0; i < 8; ++i) fit.add_round_trip(500);
  EXPECT_DOUBLE_EQ(fit.launch_us(), 500);
}

// A sharded step on one channel, R0 R1 G0 R2: each span counts from when the
// link was free, a bucket's gather with its reduction.
TEST(LinkEstimate, BusyTimeCountsGathersWithTheirBucket) {
  using ddpx::hooks::LinkSpan;
  const std::vector<LinkSpan> spans = {
      {200, 400, 2},  // R2, launched while R1 was on the link, G0 queued before it
      {0, 100, 0},    // R0
      {250, 300, 0},  // G0, behind R1
      {50, 250, 1},   // R1, launched while R0 was on the link
  };
  const auto busy = ddpx::hooks::link_busy_us(spans, 4);
  ASSERT_EQ(busy.size(), 4u);
  EXPECT_DOUBLE_EQ(busy[0], 100 + 50);
  EXPECT_DOUBLE_EQ(busy[1], 150);
  EXPECT_DOUBLE_EQ(busy[2], 100);  // from G0's end
  EXPECT_DOUBLE_EQ(busy[3], -1);   // no span: no sample
}

// Later steps outweigh old ones: a link that halves its rate is learnt.
TEST(UseRate, AveragesPlainlyFirstThenForgets) {
  ddpx::hooks::UseRate rate(3, 0.25);
  EXPECT_DOUBLE_EQ(rate[0], 1.0);  // before any step: assume sent
  // Two experts on alternate steps, and a parameter always used.
  rate.observe({1, 0, 1});
  rate.observe({0, 1, 1});
  EXPECT_DOUBLE_EQ(rate[0], 0.5);  // the mean of what was seen, at once
  EXPECT_DOUBLE_EQ(rate[1], 0.5);
  EXPECT_DOUBLE_EQ(rate[2], 1.0);
  for (int s = 0; s < 40; ++s)
    rate.observe({static_cast<char>(s % 2), static_cast<char>(1 - s % 2), 1});
  EXPECT_NEAR(rate[0], 0.5, 0.08);
  EXPECT_NEAR(rate[0] + rate[1], 1.0, 1e-9);
  // It forgets: an expert dropped for good falls below 5% within 12 steps.
  for (int s = 0; s < 12; ++s) rate.observe({0, 1, 1});
  EXPECT_LT(rate[0], 0.05);
  EXPECT_GT(rate[1], 0.95);
}

TEST(LinkEstimate, FollowsAChangedLink) {
  ddpx::hooks::LinkEstimate fit;
  fit.add_step({{1e6, 10100}});
  EXPECT_NEAR(fit.bytes_per_us(), 100, 1e-9);
  for (int step = 0; step < 12; ++step) fit.add_step({{1e6, 20100}});
  EXPECT_NEAR(fit.bytes_per_us(), 50, 1);
  fit.add_step({});  // a step without reductions changes nothing
  EXPECT_NEAR(fit.bytes_per_us(), 50, 1);
}

// Four one-parameter buckets of 1000 bytes, their gradients at 10, 20, 30
// and 40 us; a reduction costs 5 us plus its bytes at the link's rate.
std::vector<BucketPlan> four_buckets(std::vector<char> late = {0, 0, 0, 0}) {
  std::vector<BucketPlan> plan(4);
  for (int b = 0; b < 4; ++b) {
    plan[b].params = {b};
    plan[b].numel = 250;
    plan[b].late = late[b] != 0;
  }
  return plan;
}

ddpx::hooks::PlanTiming four_times(double bytes_per_us) {
  ddpx::hooks::PlanTiming t;
  t.arrival_us = {10, 20, 30, 40};
  t.bytes_per_us = bytes_per_us;
  t.launch_us = 5;
  return t;
}

TEST(PriorityTail, HoldsTheBucketsThatWaitPastTheEndOfBackward) {
  // 1 byte/us: bucket 0 starts at 10 and holds the link until 1015, so 1,
  // 2 and 3 would all start after backward ends (40): held.
  EXPECT_EQ(ddpx::hooks::priority_tail(four_buckets(), four_times(1.0)),
            (std::vector<char>{0, 1, 1, 1}));
}

TEST(PriorityTail, HoldsNothingWhenTheLinkKeepsUp) {
  // 1000 bytes/us: each bucket is sent before the next fills; only the last
  // starts at the end, and one bucket alone has nothing to overtake.
  EXPECT_EQ(ddpx::hooks::priority_tail(four_buckets(), four_times(1000.0)),
            (std::vector<char>{0, 0, 0, 0}));
  // Unknown rate: no prediction, no priority.
  EXPECT_EQ(ddpx::hooks::priority_tail(four_buckets(), four_times(0.0)),
            (std::vector<char>{0, 0, 0, 0}));
}

TEST(PriorityTail, LeavesLateBucketsToTheAgreement) {
  // The last bucket is late (launched after the used-parameter agreement):
  // the held run ends before it.
  EXPECT_EQ(ddpx::hooks::priority_tail(four_buckets({0, 0, 0, 1}), four_times(1.0)),
            (std::vector<char>{0, 1, 1, 0}));
  // A late bucket inside the run ends it there.
  EXPECT_EQ(ddpx::hooks::priority_tail(four_buckets({0, 0, 1, 0}), four_times(1.0)),
            (std::vector<char>{0, 0, 0, 0}));
}

TEST(PrioritySplit, CutsTheBucketOnTheLinkAtTheEndOfBackward) {
  // 20 bytes/us: bucket 0 (1000 bytes) is on the link from 10 to 65, past
  // backward's end (40), and 1..3 wait behind it (held). Left at the end:
  // 25 us, 500 bytes = 125 floats, rounded up to pieces of 10: its last 130
  // elements go after the held buckets.
  const auto plan = four_buckets();
  const auto timing = four_times(20.0);
  const auto held = ddpx::hooks::priority_tail(plan, timing);
  ASSERT_EQ(held, (std::vector<char>{0, 1, 1, 1}));
  const auto split = ddpx::hooks::priority_split(plan, held, timing, 10);
  EXPECT_EQ(split.bucket, 0);
  EXPECT_EQ(split.from, 120);
  // Pieces as large as the bucket: nothing would be left to send first.
  EXPECT_EQ(ddpx::hooks::priority_split(plan, held, timing, 250).bucket, -1);
  // Nothing held: nothing to overtake it.
  EXPECT_EQ(ddpx::hooks::priority_split(plan, {0, 0, 0, 0}, timing, 10).bucket, -1);
  // Unknown rate: no prediction.
  EXPECT_EQ(ddpx::hooks::priority_split(plan, held, four_times(0.0), 10).bucket, -1);
}

TEST(PrioritySplit, OneHeldBucketOvertakesTheCutOne) {
  // 100 bytes/us: buckets 0 and 1 are sent by 31; bucket 2 (ready at 30)
  // is on the link from 31 to 46, past the end (40), and bucket 3 waits
  // behind it -- a held run of one, which the default (two) does not hold.
  // Left of bucket 2 at the end: 600 bytes, 150 floats.
  auto timing = four_times(100.0);
  timing.arrival_us = {1, 2, 30, 40};
  const auto plan = four_buckets();
  EXPECT_EQ(ddpx::hooks::priority_tail(plan, timing), (std::vector<char>(4, 0)));
  const auto one = ddpx::hooks::priority_tail(plan, timing, 1);
  ASSERT_EQ(one, (std::vector<char>{0, 0, 0, 1}));
  const auto split = ddpx::hooks::priority_split(plan, one, timing, 10);
  EXPECT_EQ(split.bucket, 2);
  EXPECT_EQ(split.from, 100);
}

TEST(PrioritySplit, NeverCutsALateBucketOrOneDoneBeforeTheEnd) {
  const auto timing = four_times(20.0);
  // A late bucket goes after the agreement, whole.
  EXPECT_EQ(
      ddpx::hooks::priority_split(four_buckets({1, 0, 0, 0}), {0, 1, 1, 1}, timing, 10).bucket, -1);
  // 400 bytes/us: bucket 0 is done at 17.5, long before the end; the held
  // run (as given) has nothing in front of it to overtake.
  EXPECT_EQ(ddpx::hooks::priority_split(four_buckets(), {0, 1, 1, 1}, four_times(400.0), 10).bucket,
            -1);
}

TEST(PriorityTail, PiecesSplitTheHeldBucketsByBytes) {
  // Bucket 0: parameter 0; bucket 1 (held): parameters 1..8, 100 bytes
  // each, laid out in that order; order lists them 0..8.
  std::vector<BucketPlan> plan(2);
  plan[0].params = {0};
  plan[0].numel = 25;
  plan[1].params = {1, 2, 3, 4, 5, 6, 7, 8};
  plan[1].numel = 200;
  std::vector<int> order{0, 1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<ddpx::hooks::ParamInfo> info(9, {25, c10::kFloat, c10::Device(c10::kCPU)});
  // Four pieces of 200 bytes: cuts before parameters 3, 5 and 7.
  EXPECT_EQ(ddpx::hooks::priority_cuts(plan, {0, 1}, order, info, 4),
            (std::vector<char>{0, 0, 0, 1, 0, 1, 0, 1, 0}));
  // Nothing held, or one piece: no cut.
  EXPECT_EQ(ddpx::hooks::priority_cuts(plan, {0, 0}, order, info, 4), std::vector<char>(9, 0));
  EXPECT_EQ(ddpx::hooks::priority_cuts(plan, {0, 1}, order, info, 1), std::vector<char>(9, 0));
  // plan_buckets with those cuts lays the held bucket out in four.
  auto pieces =
      ddpx::hooks::plan_buckets(order, info, 1 << 20, 1 << 20, {}, {0, 1, 0, 1, 0, 1, 0, 1, 0});
  ASSERT_EQ(pieces.size(), 5u);
  EXPECT_EQ(pieces[4].params, (std::vector<int>{7, 8}));
}

}  // namespace
