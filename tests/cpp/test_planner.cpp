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

TEST(OrderPredictor, StateRoundTrips) {
  OrderPredictor a(5), b(5);
  a.observe({4, 0, 2});
  b.load_state(a.state(), a.steps_observed());
  EXPECT_EQ(a.predicted_order(), b.predicted_order());
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

TEST(BucketPlanner, LaunchDelayIsZeroForAMatchingOrder) {
  auto plan = ddpx::hooks::plan_buckets({0, 1, 2, 3}, floats({1, 1, 1, 1}), 4, 4);
  EXPECT_DOUBLE_EQ(ddpx::hooks::launch_delay(plan, {0, 1, 2, 3}, 4), 0.0);
  EXPECT_GT(ddpx::hooks::launch_delay(plan, {3, 2, 1, 0}, 4), 0.3);
}

}  // namespace
