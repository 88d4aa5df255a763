// The measured priority switch of GradSync (hooks/priority_trial.h): the
// trial's schedule (8 steps with priority, 8 without, once the plan holds
// buckets, again after the retrial period), which window each step period
// counts for, the verdict from the medians, and that every rank, given the
// same agreed verdict, switches alike.
#include "hooks/priority_trial.h"

#include <gtest/gtest.h>

#include <vector>

namespace {

using ddpx::hooks::PriorityTrial;

// Runs steps first..last: each step's mode from begin(), then its period:
// `fast` us if the step before it had priority on, else `slow` (rank 0's
// view), the verdict settled as the agreement would. Returns the modes.
std::vector<bool> run(PriorityTrial& t, int first, int last, double with, double without,
                      bool holds = true) {
  std::vector<bool> modes;
  bool prev = true;
  for (int s = first; s <= last; ++s) {
    const bool on = t.begin(s, holds);
    modes.push_back(on);
    if (s > first) t.observe(s, prev ? with : without);
    t.settle(s, t.verdict(s));
    prev = on;
  }
  return modes;
}

TEST(PriorityTrial, NoTrialWithoutHeldBuckets) {
  PriorityTrial t(4, 100);
  const auto modes = run(t, 1, 50, 1.0, 2.0, /*holds=*/false);
  for (bool m : modes) EXPECT_TRUE(m);  // the default, never tried
  EXPECT_FALSE(t.in_trial(10));
}

TEST(PriorityTrial, WindowsOnThenOffAndPriorityStaysWhenItPays) {
  PriorityTrial t(4, 100);
  const auto modes = run(t, 1, 20, /*with=*/10.0, /*without=*/12.0);
  // Steps 1-4 with priority, 5-8 first in first out, then the verdict: on.
  const std::vector<bool> want{1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  EXPECT_EQ(modes, want);
  EXPECT_TRUE(t.decided_on());
}

TEST(PriorityTrial, PriorityGoesOffWhenFirstInFirstOutIsFaster) {
  PriorityTrial t(4, 100);
  const auto modes = run(t, 1, 20, /*with=*/12.0, /*without=*/10.0);
  EXPECT_TRUE(modes[9 - 1]);  // the verdict's own step: chosen before it came
  for (int s = 10; s <= 20; ++s) EXPECT_FALSE(modes[s - 1]) << s;
  EXPECT_FALSE(t.decided_on());
}

TEST(PriorityTrial, EqualMediansDoNotKeepPriority) {
  PriorityTrial t(4, 100);
  run(t, 1, 12, 10.0, 10.0);
  EXPECT_FALSE(t.decided_on());  // on only when measured to pay
}

TEST(PriorityTrial, TriesAgainAfterTheRetrialPeriod) {
  PriorityTrial t(4, 20);
  run(t, 1, 10, 12.0, 10.0);  // off after the first trial (verdict at step 9)
  EXPECT_FALSE(t.decided_on());
  // Now priority pays: the next trial, due at step 9 + 20, turns it back on.
  const auto modes = run(t, 11, 45, 10.0, 12.0);
  EXPECT_FALSE(modes[0]);              // step 11: off
  EXPECT_TRUE(modes[29 - 11]);         // step 29: the trial's first window
  EXPECT_FALSE(modes[33 - 11]);        // step 33: its second
  EXPECT_TRUE(modes[45 - 11]);         // after its verdict (step 37)
  EXPECT_TRUE(t.decided_on());
}

TEST(PriorityTrial, ATrialWhoseVerdictNeverCameIsDropped) {
  PriorityTrial t(4, 20);
  for (int s = 1; s <= 8; ++s) t.begin(s, true);
  // Step 9 failed: no verdict settled. Step 10 goes on with the old choice.
  EXPECT_TRUE(t.begin(10, true));
  EXPECT_FALSE(t.in_trial(10));
  EXPECT_EQ(t.verdict(10), 0);
}

TEST(PriorityTrial, OnlyTheVerdictStepSpeaks) {
  PriorityTrial t(4, 100);
  for (int s = 1; s <= 8; ++s) {
    t.begin(s, true);
    if (s > 1) t.observe(s, 1.0);
    EXPECT_EQ(t.verdict(s), 0) << s;
  }
  t.begin(9, true);
  t.observe(9, 1.0);
  EXPECT_NE(t.verdict(9), 0);
}

}  // namespace
