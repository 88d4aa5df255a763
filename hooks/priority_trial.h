#pragma once
// GradSyncOptions::priority, measured (Overlap::NextForward): the held
// buckets go first layer first only while that is measured to pay. When a
// plan first holds buckets, and again every `retrial` steps, the steps run
// a trial: `window` steps with priority, then `window` first in, first out.
// A step's period (the end of its backward to the end of the next one's)
// shows the launch order of the step before it, whose updates the forward
// waited for; rank 0 compares the median periods of the two windows and its
// verdict travels in the step-end agreement, so every rank switches alike.
// Priority stays on only if it was faster.
#include <cstdint>
#include <vector>

namespace ddpx::hooks {

class PriorityTrial {
 public:
  explicit PriorityTrial(int window = 8, int retrial = 500) : window_(window), retrial_(retrial) {}

  // At a step's start, alike on every rank (`plan_holds`: the plan has held
  // buckets): do they go first layer first in this step?
  bool begin(int64_t step, bool plan_holds);
  // Rank 0: step `step`'s period in us (from the last step's end of backward).
  void observe(int64_t step, double period_us);
  // Rank 0, at the end of step `step`'s backward: 0 nothing to say, 1
  // priority was faster, 2 it was not.
  int verdict(int64_t step) const;
  // Every rank, once the step's agreement is in: the agreed verdict.
  void settle(int64_t step, int verdict);
  bool in_trial(int64_t step) const {
    return start_ >= 0 && step >= start_ && step < start_ + 2 * window_;
  }
  bool decided_on() const { return on_; }

 private:
  int window_, retrial_;
  int64_t start_ = -1;  // the trial's first step; -1: none running
  int64_t due_ = 0;     // no trial before this step
  bool on_ = true;      // the verdict between trials
  std::vector<double> with_, without_;  // rank 0's periods, per mode
};

}  // namespace ddpx::hooks
