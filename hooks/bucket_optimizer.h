#pragma once
// The trainer's LibTorch optimizer, stepped one bucket at a time
// (GradSync::set_optimizer). Exactness comes from running LibTorch's own
// step() code: each bucket has a sub-optimizer of the same class over the
// bucket's parameters (one param group per trainer group it touches). For
// an update the parameters' state entries move from the trainer's optimizer
// into the sub-optimizer and back, so the trainer's optimizer always owns
// the state between updates (saving and loading it works as usual), and the
// per-parameter arithmetic is the very code optimizer.step() would run.
// Under mixed precision (plugin/amp/master_weights.h) the sub-optimizer's
// groups hold the float32 masters instead of the parameters, and the state
// entries move between the trainer's key (the parameter) and the master's.
#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ddpx::hooks {

using optim_state_ptr = std::unique_ptr<torch::optim::OptimizerParamState>;

class BucketOptimizer {
 public:
  // `params`/`names`: GradSync's synced parameters. Every parameter of
  // `user` must be one of them (else an error naming it); `user` must be
  // torch::optim::SGD, Adam or AdamW and outlive GradSync.
  // `masters`: what each parameter's step updates instead (null: the
  // parameters themselves): float32 masters, or (GradSyncOptions::shard)
  // flat views of the elements this rank owns, undefined where it owns none
  // (`sharded`: the state kept under the parameter is then the size of that
  // view; a whole parameter's state, loaded from an unsharded checkpoint,
  // is cut to it at the parameter's first step here).
  BucketOptimizer(torch::optim::Optimizer& user, const std::vector<at::Tensor>& params,
                  const std::vector<std::string>& names,
                  const std::vector<at::Tensor>* masters = nullptr, bool sharded = false);

  // A new bucket plan: one sub-optimizer per bucket with stepped parameters.
  void plan(const std::vector<std::vector<int>>& buckets);
  // The groups' options for the step that begins (a schedule may change
  // them between steps, and in NextForward mode between this step's
  // backward and its last update).
  void snapshot();
  // Steps parameters `ps` of bucket `b` (their .grad holds the average);
  // parameters the optimizer does not hold are skipped. Thread-safe: a
  // sharded bucket stepped during backward runs on GradSync's stepper
  // thread, maybe while the thread completing the step steps a late one,
  // and every update moves entries of the trainer's optimizer's state map.
  void apply(int b, const std::vector<int>& ps) { step(b, ps, /*lookahead=*/false); }
  // The same step on copies of their state, never given back: the
  // parameters move, the trainer's optimizer keeps its state as it was
  // (GradSyncOptions::stale_lookahead; their .grad holds the rank's own
  // gradients). The copies are kept for the next look-ahead to copy into.
  void lookahead(int b, const std::vector<int>& ps) { step(b, ps, /*lookahead=*/true); }
  // Does parameter p's step run here (in the optimizer, and, sharded, with
  // elements this rank owns)? Is it in the optimizer at all?
  bool steps(int p) const { return group_of_[p] >= 0 && stepped_[p].defined(); }
  bool holds(int p) const { return group_of_[p] >= 0; }
  const char* kind() const;
  torch::optim::Optimizer& user() { return user_; }
  // Bytes of the state the trainer's optimizer keeps for GradSync's parameters.
  int64_t state_bytes() const;

 private:
  enum class Kind { SGD, Adam, AdamW };
  std::unique_ptr<torch::optim::Optimizer> make(std::vector<torch::optim::OptimizerParamGroup> g);
  void step(int b, const std::vector<int>& ps, bool lookahead);

  torch::optim::Optimizer& user_;
  Kind kind_;
  // Sharded: p's state entry made the size of its part (see the constructor).
  void fit_to_part(optim_state_ptr& st, int p) const;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  bool sharded_ = false;
  std::vector<at::Tensor> stepped_;  // per parameter: what its step updates (params_ or masters)
  std::vector<int> group_of_;        // per GradSync parameter: the trainer's group, -1: none
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> snap_;  // per trainer group
  struct Sub {
    std::unique_ptr<torch::optim::Optimizer> opt;  // null: nothing of the bucket is stepped
    std::vector<int> groups;                       // the trainer's group of each sub group
  };
  std::vector<Sub> subs_;  // per bucket
  std::mutex step_mu_;     // step(): one update at a time
  // The look-ahead's state copies, kept between steps so that the next one
  // copies into them (the trainer's optimizer's map type, keyed the same).
  ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>> scratch_;
};

}  // namespace ddpx::hooks
