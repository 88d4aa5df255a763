#pragma once
// Predicts the order in which parameter gradients arrive in backward, and
// which parameters go unused, from the steps seen so far.
//
// The prediction is the last observed order of the used parameters, then the
// parameters that were not used, by their average position, those usually
// unused last (their buckets launch at the end, which is when an unused
// parameter is known). stable_steps() counts how many consecutive steps
// repeated the same order: the planner re-plans only on an order seen twice
// in a row, so a one-off permutation or a noisy order never churns the plan,
// and a real change re-plans once.
#include <vector>

namespace ddpx::hooks {

class OrderPredictor {
 public:
  // Before any observation: reverse registration order (backward usually
  // visits layers last-to-first).
  explicit OrderPredictor(int num_params, double alpha = 0.5);

  // `arrival`: parameter indices in the order their gradients arrived this
  // step; the ones missing were unused.
  void observe(const std::vector<int>& arrival);

  std::vector<int> predicted_order() const;
  bool predicted_unused(int param) const { return used_ema_[param] < 0.5; }
  int steps_observed() const { return steps_; }
  int stable_steps() const { return stable_steps_; }

  // For checkpoints: [position_ema..., used_ema...] and back.
  std::vector<double> state() const;
  void load_state(const std::vector<double>& s, int steps);

 private:
  double alpha_;
  int steps_ = 0;
  int stable_steps_ = 0;
  std::vector<int> last_order_;
  std::vector<double> position_ema_;
  std::vector<double> used_ema_;
};

}  // namespace ddpx::hooks
