#pragma once
// The training run the tests of GradSync across the step boundary compare
// (test_grad_sync_overlap.cpp, test_grad_sync_stale.cpp): a small torch::nn
// model with unused parameters, trained on rank-sharded batches with
// LibTorch's optimizer after backward (the reference), or with the
// optimizer given to GradSync; optionally each step's average applied one
// step late, in the trainer (the reference of GradSyncOptions::staleness).
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "grad_sync_test_models.h"

namespace ddpx_overlap_test {

using ddpx::GradSync;
using ddpx::GradSyncOptions;
using ddpx::Overlap;
using ddpx::Unused;
using namespace ddpx::test::grad_sync;

// trunk -> (expert a on even steps, b on odd ones: unused parameters) ->
// head. `gate`, if set, is called with each layer's parameters before the
// layer runs: a torch::nn trainer's gating under Overlap::NextForward.
struct GatedImpl : torch::nn::Module {
  torch::nn::Linear trunk{nullptr}, a{nullptr}, b{nullptr}, head{nullptr};
  std::function<void(const std::vector<at::Tensor>&)> gate;
  bool both = false;  // both experts every step: no parameter unused
  GatedImpl() {
    trunk = register_module("trunk", torch::nn::Linear(6, 12));
    a = register_module("a", torch::nn::Linear(12, 12));
    b = register_module("b", torch::nn::Linear(12, 12));
    head = register_module("head", torch::nn::Linear(12, 3));
    to(at::kDouble);
  }
  template <class L>
  at::Tensor run(L& layer, const at::Tensor& x) {
    if (gate) gate(layer->parameters());
    return layer(x);
  }
  at::Tensor forward(const at::Tensor& x, int step) {
    auto h = torch::tanh(run(trunk, x));
    h = torch::tanh(both ? run(a, h) + run(b, h) : step % 2 == 0 ? run(a, h) : run(b, h));
    return run(head, h).pow(2).mean();
  }
};
TORCH_MODULE(Gated);

enum class Opt { SgdNesterov, AdamW, Adam };

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(Gated& m, Opt kind) {
  // Two groups: the weights with weight decay, the biases without.
  std::vector<at::Tensor> weights, biases;
  for (const auto& item : m->named_parameters()) {
    (item.key().find("bias") != std::string::npos ? biases : weights).push_back(item.value());
  }
  using namespace torch::optim;
  switch (kind) {
    case Opt::SgdNesterov: {
      auto o = SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3);
      std::vector<OptimizerParamGroup> g{
          OptimizerParamGroup(weights, std::make_unique<SGDOptions>(o)),
          OptimizerParamGroup(biases, std::make_unique<SGDOptions>(SGDOptions(o).weight_decay(0)))};
      return std::make_unique<SGD>(g, o);
    }
    case Opt::AdamW: {
      auto o = AdamWOptions(0.01).weight_decay(0.05);
      std::vector<OptimizerParamGroup> g{
          OptimizerParamGroup(weights, std::make_unique<AdamWOptions>(o)),
          OptimizerParamGroup(biases, std::make_unique<AdamWOptions>(AdamWOptions(o).weight_decay(0)))};
      return std::make_unique<AdamW>(g, o);
    }
    case Opt::Adam:
      return std::make_unique<Adam>(m->parameters(), AdamOptions(0.01).weight_decay(1e-3));
  }
  return nullptr;
}

// A step schedule: the learning rate set between steps, as trainers do.
inline void set_lr(torch::optim::Optimizer& o, int step) {
  const double f = step < 60 ? 1.0 : step < 120 ? 0.5 : 0.25;
  for (auto& g : o.param_groups()) {
    if (!g.has_options()) continue;
    if (auto* s = dynamic_cast<torch::optim::SGDOptions*>(&g.options())) s->lr(0.05 * f);
    if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&g.options())) w->lr(0.01 * f);
    if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&g.options())) a->lr(0.01 * f);
  }
}

struct TrainRun {
  Overlap overlap = Overlap::None;
  Opt opt = Opt::SgdNesterov;
  Unused unused = Unused::Predict;
  std::string codec = "none";
  int micro = 1;           // micro-batches per step; all but the last under no_sync
  int steps = 200;
  int resume_at = -1;      // save and rebuild everything at this step (-1: never)
  // One step stale: GradSyncOptions::staleness(1) with Overlap::Optimizer;
  // with Overlap::None (the reference) the trainer applies each step's
  // average at the end of the next backward, itself. `warmup` synchronous
  // steps first; what is pending lands at `resume_at` (synchronize()) and
  // at the end.
  int staleness = 0;
  int warmup = 0;
  // GradSyncOptions::stale_lookahead; the reference steps a copy of its
  // optimizer on the rank's own gradients after each late update.
  bool lookahead = false;
  bool same_data = false;      // every rank trains on rank 0's shard
  int64_t* replans = nullptr;  // if set: the last GradSync's re-plans
  // Where the model and its batches live (test_grad_sync_cuda_modes.cpp: CUDA),
  // and the group (null: world(), ddpx_mpi under mpirun).
  at::Device device = at::kCPU;
  ddpx::comm::ProcessGroupPtr group = nullptr;
  // GradSyncOptions::shard: GradSync steps the optimizer in every overlap
  // mode (Overlap::None included).
  ddpx::Shard shard = ddpx::Shard::None;
  // Global-norm clipping: GradSyncOptions::clip_grad_norm, or in the
  // reference torch::nn::utils::clip_grad_norm_ before optimizer.step().
  double clip = 0;
  bool every_param_used = false;  // Gated::both
  // GradSyncOptions::stage_chunk_bytes (CUDA buckets through host memory).
  int64_t stage_chunk_bytes = GradSyncOptions{}.stage_chunk_bytes_;
  bool steps_in_sync() const { return overlap != Overlap::None || shard != ddpx::Shard::None; }
};

// The reference of staleness(1), in the trainer: the average of step t is
// kept and applied with step t's learning rate after step t+1's backward.
// With a look-ahead, the parameters then take one more step on `local`
// (the rank's own gradients of step t+1) by an optimizer of the same kind
// loaded from the trainer's (so the trainer's state does not move), and
// the next update starts from the values before it.
class LateApply {
 public:
  using Make = std::function<std::unique_ptr<torch::optim::Optimizer>()>;
  // After backward: apply the pending average, keep this one.
  void after_backward(torch::optim::Optimizer& opt, const std::vector<at::Tensor>& ps, int step,
                      const std::vector<at::Tensor>& local = {}, const Make& make = {}) {
    std::vector<at::Tensor> now;
    for (const auto& p : ps) now.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    apply(opt, ps);
    pending_ = std::move(now);
    step_ = step;
    if (local.empty()) return;
    std::stringstream bytes;
    torch::save(opt, bytes);
    auto ahead = make();
    torch::load(*ahead, bytes);
    set_lr(*ahead, step);
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> avg;
    for (size_t i = 0; i < ps.size(); ++i) {
      committed_.push_back(ps[i].detach().clone());
      avg.push_back(std::exchange(ps[i].mutable_grad(), local[i]));
    }
    ahead->step();
    for (size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = avg[i];
  }
  void apply(torch::optim::Optimizer& opt, const std::vector<at::Tensor>& ps) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < committed_.size(); ++i) ps[i].detach().copy_(committed_[i]);
    committed_.clear();
    if (step_ < 0) return;
    std::vector<at::Tensor> now;
    for (size_t i = 0; i < ps.size(); ++i) {
      now.push_back(ps[i].grad());
      ps[i].mutable_grad() = pending_[i];
    }
    set_lr(opt, step_);
    opt.step();
    for (size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = now[i];
    step_ = -1;
  }

 private:
  std::vector<at::Tensor> pending_, committed_;
  int step_ = -1;
};

// Trains a fresh model (seed 7) for r.steps steps on rank-sharded batches
// and returns its parameters. Overlap::None steps LibTorch's optimizer after
// backward (the reference); the others give it to GradSync.
inline std::vector<at::Tensor> train(const TrainRun& r) {
  const auto pg = r.group ? r.group : world();
  const int rank = pg->getRank();
  GradSyncOptions so;
  so.overlap(r.overlap).unused(r.unused).codec(r.codec).bucket_cap_mb(0.001).first_bucket_mb(0.0005);
  so.shard(r.shard).clip_grad_norm(r.steps_in_sync() ? r.clip : 0.0);
  so.stage_chunk_bytes(r.stage_chunk_bytes);
  // Timing re-plans differ between runs; with a lossy codec the plan
  // decides the sums, so the runs must keep one plan to compare bit for bit.
  if (r.codec != "none") so.replan(false);
  if (r.overlap != Overlap::None) {
    so.staleness(r.staleness).stale_warmup(r.warmup).stale_lookahead(r.lookahead);
  }
  LateApply late;  // the reference's, with staleness
  torch::manual_seed(7);
  Gated m;
  m->both = r.every_param_used;
  m->to(r.device);
  auto opt = make_optimizer(m, r.opt);
  auto sync = std::make_unique<GradSync>(m->named_parameters(), pg, so);
  if (r.steps_in_sync()) sync->set_optimizer(*opt);
  if (r.overlap == Overlap::NextForward) {
    m->gate = [&sync](const std::vector<at::Tensor>& ps) { sync->wait_ready(ps); };
  }
  for (int step = 0; step < r.steps; ++step) {
    if (step == r.resume_at && !r.steps_in_sync()) late.apply(*opt, m->parameters());
    if (step == r.resume_at && r.steps_in_sync()) {
      // A checkpoint: parameters and optimizer state, written and read back
      // into a new model, optimizer and GradSync (the trainer's way).
      sync->synchronize();
      std::stringstream model_bytes, opt_bytes;
      torch::save(m, model_bytes);
      torch::save(*opt, opt_bytes);
      sync.reset();
      torch::manual_seed(99);  // other initial values: the load must restore them
      m = Gated();
      m->both = r.every_param_used;
      torch::load(m, model_bytes, r.device);
      opt = make_optimizer(m, r.opt);
      torch::load(*opt, opt_bytes);
      sync = std::make_unique<GradSync>(m->named_parameters(), pg, so);
      sync->set_optimizer(*opt);
      if (r.overlap == Overlap::NextForward) {
        m->gate = [&sync](const std::vector<at::Tensor>& ps) { sync->wait_ready(ps); };
      }
    }
    set_lr(*opt, step);
    if (!r.steps_in_sync()) opt->zero_grad();
    const bool stale_ref = r.overlap == Overlap::None && r.staleness > 0 && step >= r.warmup;
    std::vector<at::Tensor> local;  // the reference's look-ahead: this rank's own gradients
    for (int k = 0; k < r.micro; ++k) {
      auto x = shard(global_batch(6, 1000 * step + k), r.same_data ? 0 : rank).to(r.device);
      if (k + 1 < r.micro) {
        auto guard = sync->no_sync();
        m->forward(x, step).backward();
      } else {
        auto loss = m->forward(x, step);
        if (r.unused == Unused::Exact) sync->prepare_for_backward({loss});
        if (stale_ref && r.lookahead) {
          // (autograd::grad runs no AccumulateGrad node: GradSync sees nothing.)
          const auto ps = m->parameters();
          local = torch::autograd::grad({loss}, ps, {}, /*retain_graph=*/true,
                                        /*create_graph=*/false, /*allow_unused=*/true);
          for (size_t i = 0; i < ps.size(); ++i) {
            if (ps[i].grad().defined() && local[i].defined()) local[i] = ps[i].grad() + local[i];
          }
        }
        loss.backward();
      }
    }
    if (!r.steps_in_sync() && (r.staleness == 0 || step < r.warmup)) {
      if (r.clip > 0) torch::nn::utils::clip_grad_norm_(m->parameters(), r.clip);
      opt->step();
    }
    if (stale_ref) {
      late.after_backward(*opt, m->parameters(), step, local,
                          [&] { return make_optimizer(m, r.opt); });
    }
  }
  late.apply(*opt, m->parameters());
  sync->synchronize();
  if (r.replans) *r.replans = sync->replans();
  std::vector<at::Tensor> out;
  for (const auto& p : m->parameters()) out.push_back(p.detach().cpu().clone());
  return out;
}

inline TrainRun with(Overlap o, Opt opt, Unused u = Unused::Predict, int micro = 1,
              std::string codec = "none", int resume_at = -1) {
  TrainRun r;
  r.overlap = o;
  r.opt = opt;
  r.unused = u;
  r.micro = micro;
  r.codec = std::move(codec);
  r.resume_at = resume_at;
  return r;
}

// A named run, the parameter of the suites that compare runs.
struct Case {
  const char* name;
  TrainRun run;
};
inline void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

inline void expect_bitwise(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want,
                    const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(at::equal(got[i], want[i]))
        << what << ": parameter " << i << " differs by up to "
        << (got[i] - want[i]).abs().max().item<double>();
  }
}

// `ours` leaves the parameters bit for bit where the synchronous path
// (Overlap::None, no resume) leaves them, and that reference moved from the
// initial model.
inline void expect_same_as_synchronous(const TrainRun& ours, const std::string& what) {
  TrainRun ref = ours;
  ref.overlap = Overlap::None;
  ref.shard = ddpx::Shard::None;
  ref.resume_at = -1;
  const auto want = train(ref);
  expect_bitwise(train(ours), want, what);
  TrainRun none = ref;
  none.steps = 0;
  EXPECT_FALSE(at::equal(want[0], train(none)[0])) << what << ": the reference did not train";
}

}  // namespace ddpx_overlap_test
