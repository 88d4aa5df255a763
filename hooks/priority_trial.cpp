// The measured priority switch (hooks/priority_trial.h).
#include "hooks/priority_trial.h"

#include <algorithm>

namespace ddpx::hooks {

namespace {
double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}
}  // namespace

bool PriorityTrial::begin(int64_t step, bool plan_holds) {
  // A trial whose verdict never came (its last step failed) is dropped.
  if (start_ >= 0 && step > start_ + 2 * window_) {
    start_ = -1;
    due_ = step + retrial_;
  }
  if (start_ < 0 && plan_holds && step >= due_) {
    start_ = step;
    with_.clear();
    without_.clear();
  }
  if (!in_trial(step)) return on_;
  return step - start_ < window_;
}

void PriorityTrial::observe(int64_t step, double period_us) {
  // The period of step s shows the launch order of step s-1.
  const int64_t shown = step - 1;
  if (!in_trial(shown)) return;
  (shown - start_ < window_ ? with_ : without_).push_back(period_us);
}

int PriorityTrial::verdict(int64_t step) const {
  if (start_ < 0 || step != start_ + 2 * window_) return 0;
  if (with_.empty() || without_.empty()) return 2;
  return median(with_) < median(without_) ? 1 : 2;
}

void PriorityTrial::settle(int64_t step, int verdict) {
  if (verdict == 0) return;
  on_ = verdict == 1;
  start_ = -1;
  due_ = step + retrial_;
}

}  // namespace ddpx::hooks
