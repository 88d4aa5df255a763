// Order predictor and bucket planner, single process: pure logic.
#include <gtest/gtest.h>

#include "hooks/bucket_planner.h"
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

TEST(OrderPredictor, LatenessCanFollowAgreedMisses) {
  // This rank used everything; another rank missed parameter 1.
  OrderPredictor p(3);
  const std::vector<char> missed{0, 1, 0};
  p.observe({2, 1, 0}, &missed);
  EXPECT_EQ(p.late_set(), (std::vector<char>{0, 1, 0}));
  EXPECT_FALSE(p.predicted_unused(1));  // the order and use still follow this rank
  EXPECT_EQ(p.predicted_order(), (std::vector<int>{2, 0, 1}));
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

TEST(BucketPlanner, LaunchDelayIsZeroForAMatchingOrder) {
  auto plan = ddpx::hooks::plan_buckets({0, 1, 2, 3}, floats({1, 1, 1, 1}), 4, 4);
  EXPECT_DOUBLE_EQ(ddpx::hooks::launch_delay(plan, {0, 1, 2, 3}, 4), 0.0);
  EXPECT_GT(ddpx::hooks::launch_delay(plan, {3, 2, 1, 0}, 4), 0.3);
}

}  // namespace
