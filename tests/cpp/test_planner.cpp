// Order predictor and bucket planner, single process: pure logic. (The link
// estimate and the priority tail: test_planner_timing.cpp.)
#include <gtest/gtest.h>

#include <chrono>

#include "hooks/bucket_planner.h"
#include "hooks/link_estimate.h"
#include "hooks/order_predictor.h"

namespace {

using ddpx::hooks::BucketPlan;
using ddpx::hooks::OrderPredictor;
using ddpx::hooks::ParamInfo;

std::vector<ParamInfo> floats(std::vector<int64_t> numels) {
  std::vector<ParamInfo> v;
  for (auto n : numels) v.push_back({n, c10::ScalarType::Float, c10::Device(c10::kCPU)});
  return v;
}

TEST(OrderPredictor, StartsFromReverseRegistrationOrder) {
  OrderPredictor p(4);
  EXPECT_EQ(p.predicted_order(), (std::vector<int>{3, 2, 1, 0}));
}

TEST(OrderPredictor, LearnsANewOrderAndStaysStable) {
  OrderPredictor p(4);
  p.observe({0, 1, 2, 3});
  EXPECT_EQ(p.predicted_order(), (std::vector<int>{0, 1, 2, 3}));
  for (int i = 0; i < 20; ++i) p.observe({0, 1, 2, 3});
  EXPECT_EQ(p.predicted_order(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(p.stable_steps(), 20);
  p.observe({3, 2, 1, 0});  // a new order: predicted, but not yet stable
  EXPECT_EQ(p.stable_steps(), 0);
  p.observe({3, 2, 1, 0});
  EXPECT_EQ(p.stable_steps(), 1);
  EXPECT_EQ(p.predicted_order(), (std::vector<int>{3, 2, 1, 0}));
}

TEST(OrderPredictor, UsuallyUnusedParametersGoLast) {
  OrderPredictor p(3);
  p.observe({2, 1});  // 0 unused
  p.observe({2, 1});
  EXPECT_TRUE(p.predicted_unused(0));
  EXPECT_EQ(p.predicted_order(), (std::vector<int>{2, 1, 0}));
  EXPECT_EQ(p.predicted_order().back(), 0);
  p.observe({0, 1, 2});
  p.observe({0, 1, 2});
  EXPECT_FALSE(p.predicted_unused(0));
}

TEST(OrderPredictor, IntermittentlyUsedParametersStayLateWithoutChurn) {
  OrderPredictor p(4);  // 3 and 2 used always, 1 and 0 on alternate steps
  p.observe({3, 1, 2});
  EXPECT_EQ(p.late_set(), (std::vector<char>{1, 0, 0, 0}));
  p.observe({3, 0, 2});
  EXPECT_EQ(p.late_set(), (std::vector<char>{1, 1, 0, 0}));
  EXPECT_EQ(p.late_stable_steps(), 0);
  const auto order = p.predicted_order();
  for (int s = 0; s < 20; ++s) {
    p.observe(s % 2 ? std::vector<int>{3, 0, 2} : std::vector<int>{3, 1, 2});
    EXPECT_EQ(p.predicted_order(), order) << "step " << s;
  }
  EXPECT_EQ(p.late_stable_steps(), 20);
  // The raw order alternates, the reliable one (3, 2) repeats: stable, so
  // timing re-plans stay possible for such a model.
  EXPECT_EQ(p.stable_steps(), 20);
  EXPECT_EQ(order, (std::vector<int>{3, 2, 1, 0}));  // reliable in arrival order, then late
  // Steady use makes a late parameter reliable again: after one miss about
  // 30 steps, after a long alternation (miss average near 1/2) about 85.
  for (int s = 0; s < 60; ++s) p.observe({3, 1, 0, 2});
  EXPECT_EQ(p.late_set(), (std::vector<char>{1, 1, 0, 0}));
  for (int s = 0; s < 30; ++s) p.observe({3, 1, 0, 2});
  EXPECT_EQ(p.late_set(), (std::vector<char>{0, 0, 0, 0}));
  OrderPredictor once(2);
  once.observe({1, 0});
  once.observe({1});
  EXPECT_TRUE(once.late(0));
  for (int s = 0; s < 32; ++s) once.observe({1, 0});
  EXPECT_FALSE(once.late(0));
}

TEST(OrderPredictor, LateParametersGoWhereTheyArriveUnlessLast) {
  OrderPredictor p(4);  // 3 and 2 always; 1, then 0 in between
  p.observe({3, 1, 2});
  p.observe({3, 0, 2});
  EXPECT_EQ(p.late_set(), (std::vector<char>{1, 1, 0, 0}));
  // Predict: late buckets launch at the end, so late parameters go last.
  EXPECT_EQ(p.predicted_order(), (std::vector<int>{3, 2, 1, 0}));
  // Exact: by position (1 at 0.5; 0 at 0.75, its first guess 1.0 averaged
  // with 0.5), between the reliable 3 (first) and 2 (last).
  EXPECT_EQ(p.predicted_order(/*late_last=*/false), (std::vector<int>{3, 1, 0, 2}));
}

TEST(OrderPredictor, LatenessCanFollowAgreedMisses) {
  // This rank used everything; another rank missed parameter 1.
  OrderPredictor p(3);
  const std::vector<char> missed{0, 1, 0};
  p.observe({2, 1, 0}, &missed);
  EXPECT_EQ(p.late_set(), (std::vector<char>{0, 1, 0}));
  EXPECT_FALSE(p.predicted_unused(1));  // the order and use still follow this rank
  EXPECT_EQ(p.predicted_order(), (std::vector<int>{2, 0, 1}));
}

TEST(OrderPredictor, AveragesArrivalTimesOfUsedParameters) {
  OrderPredictor p(3);
  EXPECT_TRUE(p.predicted_arrival_us().empty());
  p.observe({2, 1, 0});  // untimed: no times
  EXPECT_EQ(p.timed_steps(), 0);
  const std::vector<double> t1{300, 100, 0}, t2{500, -1, 0};  // 1 unused in step 2
  p.observe({2, 1, 0}, nullptr, &t1);
  EXPECT_EQ(p.predicted_arrival_us(), t1);  // the first timed step is taken as it is
  p.observe({2, 0}, nullptr, &t2);
  EXPECT_EQ(p.predicted_arrival_us(), (std::vector<double>{400, 100, 0}));  // alpha 0.5
  EXPECT_EQ(p.timed_steps(), 2);
  p.load_state(p.state(), p.steps_observed());  // times are not state: re-learnt
  EXPECT_TRUE(p.predicted_arrival_us().empty());
  EXPECT_EQ(p.timed_steps(), 0);
}

TEST(OrderPredictor, StateRoundTrips) {
  OrderPredictor a(5), b(5);
  a.observe({4, 0, 2});
  b.load_state(a.state(), a.steps_observed());
  EXPECT_EQ(a.predicted_order(), b.predicted_order());
  EXPECT_EQ(a.late_set(), b.late_set());
  EXPECT_THROW(b.load_state({1.0}, 1), c10::Error);
}

TEST(BucketPlanner, RespectsCapsAndFirstBucket) {
  // 4-byte floats: caps of 40 bytes (first) and 100 bytes.
  auto plan = ddpx::hooks::plan_buckets({0, 1, 2, 3, 4}, floats({5, 5, 10, 20, 1}), 40, 100);
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[0].params, (std::vector<int>{0, 1}));
  EXPECT_EQ(plan[1].params, (std::vector<int>{2}));  // 10 + 20 floats = 120 bytes > 100
  EXPECT_EQ(plan[2].params, (std::vector<int>{3, 4}));
  EXPECT_EQ(plan[2].numel, 21);
}

TEST(BucketPlanner, SeparatesDtypes) {
  auto info = floats({4, 4, 4});
  info[1].dtype = c10::ScalarType::Double;
  auto plan = ddpx::hooks::plan_buckets({0, 1, 2}, info, 1 << 20, 1 << 20);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].params, (std::vector<int>{0, 2}));
  EXPECT_EQ(plan[1].dtype, c10::ScalarType::Double);
}

TEST(BucketPlanner, LateParametersGetTheirOwnBuckets) {
  const std::vector<char> late{0, 1, 0, 1};
  auto plan = ddpx::hooks::plan_buckets({0, 2, 1, 3}, floats({1, 1, 1, 1}), 1 << 20, 1 << 20, late);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].params, (std::vector<int>{0, 2}));
  EXPECT_FALSE(plan[0].late);
  EXPECT_EQ(plan[1].params, (std::vector<int>{1, 3}));
  EXPECT_TRUE(plan[1].late);
  EXPECT_DOUBLE_EQ(ddpx::hooks::launch_delay(plan, {0, 2, 1, 3}, 4), 0.0);
  // A late bucket launches at the end, whenever its gradients came: a
  // reliable bucket planned after it waits that long.
  auto bad = ddpx::hooks::plan_buckets({1, 0}, floats({1, 1}), 1 << 20, 1 << 20, {0, 1});
  ASSERT_EQ(bad.size(), 2u);
  EXPECT_DOUBLE_EQ(ddpx::hooks::launch_delay(bad, {0, 1}, 2), 0.5);
}

TEST(BucketPlanner, SparseParametersGetABucketEachWhereTheyArrive) {
  // 0 and 2 dense and reliable, 1 sparse, 3 sparse and late, 4 late dense.
  auto info = floats({1, 100, 1, 100, 1});
  info[1].sparse = info[3].sparse = true;
  const std::vector<char> late{0, 0, 0, 1, 1};
  auto plan = ddpx::hooks::plan_buckets({0, 1, 2, 4, 3}, info, 1 << 20, 1 << 20, late);
  ASSERT_EQ(plan.size(), 4u);
  // Listed (so launched) before the dense bucket, open around it until 2 arrives.
  EXPECT_EQ(plan[0].params, (std::vector<int>{1}));
  EXPECT_TRUE(plan[0].sparse);
  EXPECT_EQ(plan[0].numel, 0);  // no dense storage
  EXPECT_EQ(plan[1].params, (std::vector<int>{0, 2}));
  EXPECT_FALSE(plan[1].sparse);
  // Late dense 4 came before late sparse 3, which goes after it; it is
  // never in a late bucket itself: its own reduction tells the ranks who used it.
  EXPECT_EQ(plan[2].params, (std::vector<int>{4}));
  EXPECT_TRUE(plan[2].late);
  EXPECT_EQ(plan[3].params, (std::vector<int>{3}));
  EXPECT_TRUE(plan[3].sparse);
  EXPECT_FALSE(plan[3].late);
  // Last in backward after a bucket that is complete: after it.
  auto tail = ddpx::hooks::plan_buckets({0, 2, 1}, info, 1 << 20, 1 << 20);
  ASSERT_EQ(tail.size(), 2u);
  EXPECT_EQ(tail[0].params, (std::vector<int>{0, 2}));
  EXPECT_EQ(tail[1].params, (std::vector<int>{1}));
  // Cuts and timing see no bytes in a sparse bucket, only its launch.
  ddpx::hooks::PlanTiming timing;
  timing.arrival_us = {100, 200, 300, -1, -1};
  timing.bytes_per_us = 1;
  timing.launch_us = 10;
  timing.late_at_end = true;
  const double finish = ddpx::hooks::predicted_finish_us(plan, timing);
  // 1 at 200 (+10), {0, 2} at 300 (+10 + 8 bytes), then the late ones at
  // the end of backward (300): 4 (+10 + 4) and 3 (+10).
  EXPECT_DOUBLE_EQ(finish, 300 + 18 + 14 + 10);
}

TEST(BucketPlanner, LaunchDelayIsZeroForAMatchingOrder) {
  auto plan = ddpx::hooks::plan_buckets({0, 1, 2, 3}, floats({1, 1, 1, 1}), 4, 4);
  EXPECT_DOUBLE_EQ(ddpx::hooks::launch_delay(plan, {0, 1, 2, 3}, 4), 0.0);
  EXPECT_GT(ddpx::hooks::launch_delay(plan, {3, 2, 1, 0}, 4), 0.3);
}

TEST(BucketPlanner, OnlyAnotherOrderPaysForAReorder) {
  const auto info = floats({1, 1, 1, 1});
  // Cut after every parameter: under a shuffled arrival, a one-bucket plan
  // of the same order launches with less waiting, but the order is the same.
  auto fine = ddpx::hooks::plan_buckets({0, 1, 2, 3}, info, 4, 4);
  auto whole = ddpx::hooks::plan_buckets({0, 1, 2, 3}, info, 1 << 20, 1 << 20);
  ASSERT_EQ(fine.size(), 4u);
  ASSERT_EQ(whole.size(), 1u);
  const std::vector<int> shuffled{3, 2, 1, 0};
  ASSERT_GT(ddpx::hooks::launch_delay(fine, shuffled, 4),
            ddpx::hooks::launch_delay(whole, shuffled, 4) + 0.02);
  EXPECT_FALSE(ddpx::hooks::reorder_pays(fine, whole, shuffled, 4));
  // The arrival order itself: fewer waits, and another order.
  auto reordered = ddpx::hooks::plan_buckets(shuffled, info, 4, 4);
  EXPECT_TRUE(ddpx::hooks::reorder_pays(fine, reordered, shuffled, 4));
  // Another order that waits no less does not pay.
  EXPECT_FALSE(ddpx::hooks::reorder_pays(reordered, fine, shuffled, 4));
}

using ddpx::hooks::PlanTiming;

std::vector<BucketPlan> timed_plan(const std::vector<int>& order,
                                   const std::vector<ParamInfo>& info, const PlanTiming& timing,
                                   std::vector<char>* cuts, const std::vector<char>& late = {}) {
  return ddpx::hooks::plan_buckets(order, info, 1LL << 30, 1LL << 30, late, {}, &timing, cuts);
}

// n gradients in registration order, one every `every_us` from 0.
struct EvenStream {
  std::vector<int> order;
  std::vector<double> t;
};
EvenStream even_stream(int n, double every_us) {
  EvenStream s;
  for (int i = 0; i < n; ++i) {
    s.order.push_back(i);
    s.t.push_back(every_us * i);
  }
  return s;
}

std::vector<std::vector<int>> members(const std::vector<BucketPlan>& plan) {
  std::vector<std::vector<int>> out;
  for (const auto& b : plan) out.push_back(b.params);
  return out;
}

TEST(BucketPlanner, TimingCutsWhereBackwardPauses) {
  // Rate unknown: a bucket closes where arrivals pause for more than the gap.
  // 0 and 1 together, a 40 ms pause, 2; 3 just after; then a short pause.
  PlanTiming timing{{0, 50, 40050, 40100, 40900}, 1000};
  std::vector<char> cuts;
  auto plan = timed_plan({0, 1, 2, 3, 4}, floats({1, 1, 1, 1, 1}), timing, &cuts);
  EXPECT_EQ(members(plan), (std::vector<std::vector<int>>{{0, 1}, {2, 3, 4}}));
  EXPECT_EQ(cuts, (std::vector<char>{0, 0, 1, 0, 0}));
  // The cuts alone reproduce the plan (what another rank is sent).
  auto again = ddpx::hooks::plan_buckets({0, 1, 2, 3, 4}, floats({1, 1, 1, 1, 1}), 1LL << 30,
                                         1LL << 30, {}, cuts);
  EXPECT_EQ(members(again), members(plan));
  timing.gap_us = 100000;
  EXPECT_EQ(timed_plan({0, 1, 2, 3, 4}, floats({1, 1, 1, 1, 1}), timing, &cuts).size(), 1u);
  // Unknown times (-1) never cut, and a bucket of unknowns has no ready time.
  PlanTiming unknown{{0, -1, 5000}, 1000};
  EXPECT_EQ(members(timed_plan({0, 1, 2}, floats({1, 1, 1}), unknown, &cuts)),
            (std::vector<std::vector<int>>{{0, 1}, {2}}));
  EXPECT_EQ(timed_plan({1, 2}, floats({1, 1, 1}), unknown, &cuts).size(), 1u);
  // Late parameters launch at the end anyway: no timing cuts among them.
  EXPECT_EQ(members(timed_plan({0, 2}, floats({1, 1, 1}), PlanTiming{{0, 0, 9000}, 1000}, &cuts,
                               {1, 0, 1})),
            (std::vector<std::vector<int>>{{0, 2}}));
}

TEST(BucketPlanner, TimingKeepsTheLinkBusyWithoutALaunchPerGradient) {
  // Ten 4000-byte gradients, one every 1000 us; the link takes 4000 us for
  // each. Ignoring the link, every arrival is a gap: ten buckets. With it,
  // a bucket closes only when the link would go idle waiting: the first
  // gradient alone, then what arrived while it was sent, then the rest.
  std::vector<double> t;
  for (int i = 0; i < 10; ++i) t.push_back(1000.0 * i);
  const std::vector<int> order{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  const auto info = floats(std::vector<int64_t>(10, 1000));
  std::vector<char> cuts;
  EXPECT_EQ(timed_plan(order, info, PlanTiming{t, 500}, &cuts).size(), 10u);
  auto plan =
      timed_plan(order, info, PlanTiming{t, 500, /*bytes_per_us=*/1, /*launch_us=*/0}, &cuts);
  EXPECT_EQ(members(plan), (std::vector<std::vector<int>>{{0}, {1, 2, 3, 4}, {5, 6, 7, 8, 9}}));
  // An even stream, one 400-byte gradient every 100 us, no pause anywhere:
  // once the idle link has waited 500 us with gradients ready, what arrived
  // goes (0..5, 2400 us on the link); the rest arrives while it is busy.
  std::vector<double> dense;
  std::vector<int> order20;
  for (int i = 0; i < 20; ++i) {
    dense.push_back(100.0 * i);
    order20.push_back(i);
  }
  auto stream = timed_plan(order20, floats(std::vector<int64_t>(20, 100)),
                           PlanTiming{dense, 500, /*bytes_per_us=*/1, /*launch_us=*/0}, &cuts);
  ASSERT_EQ(stream.size(), 2u);
  EXPECT_EQ(stream[0].params, (std::vector<int>{0, 1, 2, 3, 4, 5}));
  // Without the link's rate only pauses count: none here.
  EXPECT_EQ(
      timed_plan(order20, floats(std::vector<int64_t>(20, 100)), PlanTiming{dense, 500}, &cuts)
          .size(),
      1u);
}

TEST(BucketPlanner, PredictedFinishRewardsSendingBeforeAPause) {
  // A big gradient (0) at t=0, a small one (1) after 50 ms of backward. On a
  // link of 1000 bytes/us the big one takes 40 ms: sent alone it is done
  // before the small one arrives; sharing a bucket it waits the whole pause.
  const auto info = floats({10000000, 10});
  const std::vector<double> t{0, 50000};
  auto together = ddpx::hooks::plan_buckets({0, 1}, info, 1LL << 30, 1LL << 30);
  std::vector<char> cuts;
  auto apart = timed_plan({0, 1}, info, PlanTiming{t, 1000}, &cuts);
  ASSERT_EQ(together.size(), 1u);
  ASSERT_EQ(apart.size(), 2u);
  const PlanTiming link{t, 1000, /*bytes_per_us=*/1000, /*launch_us=*/100};
  EXPECT_DOUBLE_EQ(ddpx::hooks::predicted_finish_us(together, link), 50000 + 100 + 40000.04);
  EXPECT_DOUBLE_EQ(ddpx::hooks::predicted_finish_us(apart, link), 50000 + 100 + 0.04);
  // A late bucket is ready at the last arrival whatever its own times.
  auto late = ddpx::hooks::plan_buckets({0, 1}, info, 1LL << 30, 1LL << 30, {1, 0});
  ASSERT_EQ(late.size(), 2u);
  EXPECT_DOUBLE_EQ(ddpx::hooks::predicted_finish_us(late, PlanTiming{t, 1000, 1000, 0}),
                   50000 + 40000 + 0.04);
}

TEST(BucketPlanner, CheapestPlanCutsOnlyWhereTheLinkNeedsIt) {
  // 100 gradients of 4000 bytes, one every 100 us (10 ms of backward). (No
  // structured binding: the lambda below uses it, which clang 14 refuses.)
  const EvenStream stream = even_stream(100, 100.0);
  const std::vector<int>& order = stream.order;
  const std::vector<double>& t = stream.t;
  const auto info = floats(std::vector<int64_t>(100, 1000));
  const int64_t cap = 1LL << 30;
  auto cost_at = [&](const PlanTiming& timing, double gap) {
    PlanTiming g = timing;
    g.gap_us = gap;
    return ddpx::hooks::predicted_cost_us(
        ddpx::hooks::plan_buckets(order, info, cap, cap, {}, {}, &g), timing);
  };
  std::vector<char> cuts;
  // A fast link (1 us per gradient, 100 us a launch) has time to spare: the
  // gap rule alone launches a bucket every 500 us of backward; the cheapest
  // plan pays few launches for a tail of a few microseconds.
  const PlanTiming fast{t, 500, /*bytes_per_us=*/4000, /*launch_us=*/100};
  ASSERT_GE(timed_plan(order, info, fast, &cuts).size(), 15u);
  auto few = ddpx::hooks::plan_buckets_cheapest(order, info, cap, cap, {}, fast, &cuts);
  EXPECT_LE(few.size(), 2u);
  const double few_cost = ddpx::hooks::predicted_cost_us(few, fast);
  for (double gap : {500.0, 1000.0, 4000.0, 1e9}) EXPECT_LE(few_cost, cost_at(fast, gap)) << gap;
  // Its cuts reproduce it (what rank 0 sends the others).
  EXPECT_EQ(members(ddpx::hooks::plan_buckets(order, info, cap, cap, {}, cuts)), members(few));
  // A slow link (1 ms per gradient) is the bottleneck: waiting costs the
  // finish, so the cheapest plan keeps the gap rule's early cuts.
  const PlanTiming slow{t, 500, /*bytes_per_us=*/4, /*launch_us=*/100};
  auto busy = ddpx::hooks::plan_buckets_cheapest(order, info, cap, cap, {}, slow, &cuts);
  EXPECT_GE(busy.size(), 2u);
  EXPECT_LT(ddpx::hooks::predicted_cost_us(busy, slow), cost_at(slow, 1e9));
  // Unknown rate: the gap rule on pauses, as plan_buckets (none here).
  EXPECT_EQ(ddpx::hooks::plan_buckets_cheapest(order, info, cap, cap, {}, PlanTiming{t, 500}, &cuts)
                .size(),
            1u);
}

TEST(BucketPlanner, CheapestPlanShrinksBucketsTowardTheEndOfBackward) {
  // 400 gradients of 4000 bytes, one every 100 us (40 ms of backward), on a
  // link about as fast as backward (50 bytes/us: 80 us a gradient's bytes)
  // with a 300 us launch, as many520 on the 1 Gbit/s link. Cutting at one
  // idle gap grows the buckets toward the end and leaves the last one
  // exposed; the cheapest plan's buckets shrink instead, so that each is on
  // the wire while the next fills and the last is small.
  const auto [order, t] = even_stream(400, 100.0);
  const auto info = floats(std::vector<int64_t>(400, 1000));
  const int64_t cap = 1LL << 30;
  const PlanTiming timing{t, 800, /*bytes_per_us=*/50, /*launch_us=*/300};
  std::vector<char> cuts;
  const auto plan = ddpx::hooks::plan_buckets_cheapest(order, info, cap, cap, {}, timing, &cuts);
  ASSERT_GE(plan.size(), 4u);
  EXPECT_LT(plan.back().params.size(), plan.front().params.size() / 2);
  // Cheaper than the plan of every gap (the best: 12 buckets, 47.6 ms; this
  // one 45.8, 11 buckets from 51 gradients down to 14; the optimum over
  // every cut: 45.0), and less exposed than the cheapest of them (4.1 ms
  // after the last arrival).
  const double cost = ddpx::hooks::predicted_cost_us(plan, timing);
  double best_gap_cost = 1e18, best_gap_tail = 0;
  for (double gap = 800; gap < 1e5; gap *= 2) {
    PlanTiming g = timing;
    g.gap_us = gap;
    const auto by_gap = ddpx::hooks::plan_buckets(order, info, cap, cap, {}, {}, &g);
    if (ddpx::hooks::predicted_cost_us(by_gap, timing) < best_gap_cost) {
      best_gap_cost = ddpx::hooks::predicted_cost_us(by_gap, timing);
      best_gap_tail = ddpx::hooks::predicted_finish_us(by_gap, timing) - t.back();
    }
  }
  EXPECT_LT(cost, 0.97 * best_gap_cost);
  EXPECT_LT(ddpx::hooks::predicted_finish_us(plan, timing) - t.back(), best_gap_tail);
  EXPECT_EQ(members(ddpx::hooks::plan_buckets(order, info, cap, cap, {}, cuts)), members(plan));
}

TEST(BucketPlanner, InterleavedLateParametersStillGetACheapPlan) {
  // Under Exact, late parameters go where they arrive: n alternating late and
  // reliable ones need n buckets, more than the dynamic programme's bounds
  // (100: more buckets than it tracks; 1000: more segments than its cubic
  // time allows). The plan comes from the gaps, in well under a second.
  for (int n : {100, 1000}) {
    const auto [order, t] = even_stream(n, 10.0);
    std::vector<char> late;
    for (int i = 0; i < n; ++i) late.push_back(static_cast<char>(i % 2));
    const auto info = floats(std::vector<int64_t>(n, 100));
    PlanTiming timing{t, 200, /*bytes_per_us=*/40, /*launch_us=*/50, /*late_at_end=*/false};
    std::vector<char> cuts;
    const auto a = std::chrono::steady_clock::now();
    const auto plan =
        ddpx::hooks::plan_buckets_cheapest(order, info, 1 << 20, 1 << 20, late, timing, &cuts);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count(), 1.0);
    EXPECT_EQ(plan.size(), static_cast<size_t>(n));  // late and reliable never share a bucket
    EXPECT_EQ(members(ddpx::hooks::plan_buckets(order, info, 1 << 20, 1 << 20, late, cuts)),
              members(plan));
  }
}

TEST(BucketPlanner, LateBucketCountsOnlyTheBytesExpectedOnTheWire) {
  // One late bucket of two 4000-byte slots, ready at 0, on a link of 1 byte/us.
  const auto info = floats({1000, 1000});
  const auto plan = ddpx::hooks::plan_buckets({0, 1}, info, 1LL << 30, 1LL << 30, {1, 1});
  ASSERT_EQ(plan.size(), 1u);
  ASSERT_TRUE(plan[0].late);
  PlanTiming timing{{0, 0}, 1000, /*bytes_per_us=*/1, /*launch_us=*/0, /*late_at_end=*/false};
  EXPECT_DOUBLE_EQ(ddpx::hooks::predicted_finish_us(plan, timing), 8000);
  timing.late_bytes = {2000, 2000};  // each used on half of the steps
  EXPECT_DOUBLE_EQ(ddpx::hooks::predicted_finish_us(plan, timing), 4000);
  timing.late_bytes = {0, 0};  // used nowhere: not launched at all
  timing.launch_us = 100;
  EXPECT_DOUBLE_EQ(ddpx::hooks::predicted_finish_us(plan, timing), 0);
}

}  // namespace
