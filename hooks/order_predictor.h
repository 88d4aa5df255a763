#pragma once
// Predicts the order in which parameter gradients arrive in backward, and
// which parameters go unused, from the steps seen so far.
//
// Each parameter keeps an exponential moving average of its normalised
// arrival position (0 = first, 1 = last) and of how often it is used. The
// predicted order sorts by expected position, with parameters that are
// usually unused placed last (their buckets then launch at the end, which is
// when an unused parameter is known). A stable order converges to fixed
// scores, so it never churns the plan.
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

  // For checkpoints: [position_ema..., used_ema...] and back.
  std::vector<double> state() const;
  void load_state(const std::vector<double>& s, int steps);

 private:
  double alpha_;
  int steps_ = 0;
  std::vector<double> position_ema_;
  std::vector<double> used_ema_;
};

}  // namespace ddpx::hooks
