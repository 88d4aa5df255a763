#pragma once
// Predicts the order in which parameter gradients arrive in backward, and
// which parameters go unused, from the steps seen so far.
//
// The prediction is the last observed order of the reliably used parameters,
// then the late ones -- parameters whose gradient was missing in some recent
// step -- by their average position. Late parameters get late buckets, which
// launch at the end of backward once the ranks have agreed which parameters
// were used anywhere, so the bytes of a parameter unused on every rank are
// never sent (DDP sends its zeros). Lateness is a slow average of misses: one
// miss keeps a parameter late for about 30 steps of use, so intermittent use
// (an expert picked every other step) does not flip the plan back and forth.
// stable_steps() counts how many consecutive steps repeated the same order
// of the reliably used parameters, late_stable_steps() the same late set:
// the planner re-plans only on what was seen twice in a row, so a one-off
// permutation or a noisy order never churns the plan, and a real change
// re-plans once.
#include <vector>

namespace ddpx::hooks {

class OrderPredictor {
 public:
  // Before any observation: reverse registration order (backward usually
  // visits layers last-to-first).
  explicit OrderPredictor(int num_params, double alpha = 0.5);

  // `arrival`: parameter indices in the order their gradients arrived this
  // step; the ones missing were unused. `missed` (optional): per parameter,
  // unused on some rank (agreed across ranks); lateness then follows it
  // instead of this rank's arrival, so every rank holds the same late set.
  // `arrival_us` (optional): per parameter, when its gradient arrived, in us
  // from the start of backward (negative: it did not); averaged into
  // predicted_arrival_us(). `excused` (optional): per parameter, declared
  // unused for this step (GradSync::declare_unused, a layer-drop pattern):
  // not a miss, and what is known of it (use, position, time) stays as it
  // was; in the order it keeps its last place, so a step that only drops
  // blocks repeats the order (stable) and never re-plans.
  void observe(const std::vector<int>& arrival, const std::vector<char>* missed = nullptr,
               const std::vector<double>* arrival_us = nullptr,
               const std::vector<char>* excused = nullptr);

  // late_last: the late parameters after every reliable one, for late
  // buckets that launch at the end of backward (Unused::Predict). Otherwise
  // (Unused::Exact, where the ranks agree on use before backward, so a late
  // bucket can launch as soon as it is ready) each goes where it usually
  // arrives, by its average position.
  std::vector<int> predicted_order(bool late_last = true) const;
  bool predicted_unused(int param) const { return used_ema_[param] < 0.5; }
  bool late(int param) const { return miss_ema_[param] > kLateMiss; }
  std::vector<char> late_set() const;  // late(p) for every p
  // Per parameter, the average time its gradient arrived (us from the start
  // of backward; -1 where never seen); empty before any timed observation.
  // Not part of state(): times belong to the machine, and are re-learnt.
  const std::vector<double>& predicted_arrival_us() const { return time_ema_; }
  int timed_steps() const { return timed_steps_; }
  int steps_observed() const { return steps_; }
  int stable_steps() const { return stable_steps_; }
  int late_stable_steps() const { return late_stable_steps_; }

  // For checkpoints: [position_ema..., used_ema..., miss_ema...] and back
  // (a state without miss_ema, from before late buckets, loads as no misses).
  std::vector<double> state() const;
  void load_state(const std::vector<double>& s, int steps);

 private:
  static constexpr double kMissAlpha = 0.05;
  static constexpr double kLateMiss = 0.01;  // 0.05 * 0.95^31 < 0.01

  double alpha_;
  int steps_ = 0;
  int stable_steps_ = 0;
  int late_stable_steps_ = 0;
  int timed_steps_ = 0;
  std::vector<int> last_order_;
  std::vector<int> last_reliable_;  // last_order_ without the late parameters
  std::vector<double> time_ema_;
  std::vector<double> position_ema_;
  std::vector<double> used_ema_;
  std::vector<double> miss_ema_;
};

}  // namespace ddpx::hooks
