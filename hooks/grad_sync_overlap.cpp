// GradSync across the step boundary (GradSyncOptions::overlap): the
// trainer's optimizer stepped bucket by bucket as averages land
// (hooks/bucket_optimizer.h), and, under Overlap::NextForward, the step
// completed on a worker thread while the next forward runs, each parameter
// read waiting at its own gate (hooks/param_gate.h).
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <unordered_map>
#include <utility>
#include <vector>

#include "hooks/grad_sync_impl.h"

namespace ddpx {

bool GradSync::Impl::needs_agreement(int b) const {
  // Exact and declare_unused: the agreement may still fail the step.
  if (opts.unused_ == Unused::Exact || n_declared > 0) return true;
  for (int p : plan[b].params) {
    if (!used_here[p]) return true;  // used elsewhere? only the agreement knows
  }
  return false;
}

std::vector<int> GradSync::Impl::land_bucket(int b, const int* agreed, bool stale) {
  at::NoGradGuard no_grad;
  // A device bucket: the update is queued on this thread's stream (the
  // trainer's: complete_step runs under its streams), after the reduction
  // on the channel's stream; nothing here waits for the device.
  const c10::Device device = plan[b].device;
  if (hooks::has_streams(device) && static_cast<size_t>(b) < reduced.size() && reduced[b]) {
    reduced[b]->block(hooks::current_stream(device));
  }
  std::vector<int> stepped;
  for (int p : plan[b].params) {
    const bool used = agreed ? agreed[p] != 0 : true;
    // (Stale: the slot is the average; .grad is the next step's.)
    if (!stale || !used) write_back_param(p, used);
    // Unused on every rank: not stepped, as optimizer.step() skips a
    // parameter whose .grad zero_grad() set to none.
    if (used && optimizer->steps(p)) stepped.push_back(p);
  }
  return stepped;
}

void GradSync::Impl::step_bucket(int b, const std::vector<int>& stepped, bool stale, bool skip) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> next;  // stale: the next step's .grad, set aside
  if (stale) {
    for (int p : stepped) next.push_back(std::exchange(params[p].mutable_grad(), views[p]));
  }
  if (!skip) {
    optimizer->apply(b, stepped);
    masters.write(stepped);  // (mixed precision: what the next forward reads)
  }
  if (stale) {
    // The whole set becomes the one the step after next accumulates into.
    storage[b].zero_();
    for (size_t i = 0; i < stepped.size(); ++i) {
      params[stepped[i]].mutable_grad() = std::move(next[i]);
    }
    return;
  }
  // The update consumed the gradient (a skipped one is dropped alike): the
  // next backward starts from zero (in the slot, so it still accumulates
  // straight into the bucket). Under mixed precision both the parameter's
  // own .grad and its master's.
  for (int p : stepped) {
    bool zeroed = false;
    for (const at::Tensor* t : {static_cast<const at::Tensor*>(&params[p]), &stepped_tensor(p)}) {
      auto& g = t->mutable_grad();
      if (!is_slot(p, g)) {
        g = at::Tensor();
      } else if (!zeroed) {
        views[p].zero_();
        zeroed = true;
      }
    }
  }
  if (gates) {
    // On a device the gate opens once the update is queued; a reader's
    // stream then waits for it (Gates::wait).
    const auto queued = hooks::fence_current({plan[b].device});
    for (int p : plan[b].params) gates->open(p, queued);
  }
}

void GradSync::Impl::clip_landed(const std::vector<std::vector<int>>& landed) {
  at::NoGradGuard no_grad;
  // In parameter order, as a trainer's clip_grad_norm_(model->parameters())
  // sums them. (Their .grad: the averages, or this rank's parts of them.)
  std::vector<int> order;
  for (const auto& ps : landed) order.insert(order.end(), ps.begin(), ps.end());
  std::sort(order.begin(), order.end());
  std::vector<at::Tensor> stepped;
  for (int p : order) stepped.push_back(stepped_tensor(p));
  const double max_norm = opts.clip_grad_norm_;
  if (!shard.active()) {
    torch::nn::utils::clip_grad_norm_(stepped, max_norm);  // LibTorch's own, on the whole
    return;
  }
  // LibTorch's formula over the parts of every rank: the norm of the norms
  // (each rank's sum of its parts' squared norms, summed by one all-reduce
  // of a double), coefficient max_norm / (norm + 1e-6) clamped to 1.
  // (Read back once per device, not per parameter: each read waits for the
  // device.)
  std::unordered_map<c10::Device, std::vector<at::Tensor>> norms;
  for (const auto& t : stepped) norms[t.grad().device()].push_back(t.grad().norm().to(at::kDouble));
  at::Tensor sum = at::zeros({1}, at::kDouble);
  for (const auto& [device, ns] : norms) sum += at::stack(ns).pow(2).sum().cpu();
  channels[0]
      ->submit([&sum](c10d::ProcessGroup& pg) {
        std::vector<at::Tensor> v{sum};
        comm::detail::wait_named(pg.allreduce(v));
      })
      .get();
  const double coef = std::min(1.0, max_norm / (std::sqrt(sum.item<double>()) + 1e-6));
  for (const auto& t : stepped) t.grad().mul_(coef);
}

void GradSync::Impl::scaled_step(const std::vector<int>& seq,
                                 const std::vector<std::vector<int>>& landed,
                                 const amp::FoundInf& found) {
  // The averages are the same on every rank, so is the verdict: no
  // collective of the scaler's own. (A disabled scaler: no verdict, steps.)
  at::Tensor verdict;
  bool skip = false;
  if (scaler_inv.defined()) {
    verdict = amp::combined(found, scaler_inv.device());
    skip = verdict.item<double>() != 0;
  }
  stats.skipped = skip;
  stats.skipped_steps += skip ? 1 : 0;
  for (int b : seq) step_bucket(b, landed[b], /*stale=*/false, skip);
  if (!scaler_inv.defined()) return;
  detail::ScalerAccess::finish_step(scaler, verdict);
  scaler_inv = at::Tensor();
}

void GradSync::Impl::join() {
  if (completing.valid()) completing.get();  // (complete_step's failure is kept, not thrown)
  if (!completion_error) return;
  auto e = std::move(completion_error);
  completion_error = nullptr;
  if (gates) gates->reset();
  if (opts.staleness_ > 0) stale_reset();
  std::rethrow_exception(e);
}

void GradSync::set_optimizer(torch::optim::Optimizer& optimizer) {
  auto& I = *impl_;
  TORCH_CHECK(I.opts.overlap_ != Overlap::None || I.masters.active() || I.shard.active(),
              "GradSync::set_optimizer: GradSyncOptions::overlap is Overlap::None, where the "
              "trainer steps its optimizer after backward; choose Overlap::Optimizer or "
              "Overlap::NextForward to have GradSync step it (or mixed_precision with a "
              "param_dtype below float32, whose float32 masters only GradSync can step, or "
              "shard, whose parts only their owners can)");
  I.drain();
  std::lock_guard<std::mutex> lock(I.mu);
  TORCH_CHECK(!I.active, "GradSync::set_optimizer: called during backward");
  auto next = std::make_unique<hooks::BucketOptimizer>(
      optimizer, I.params, I.names,
      I.masters.active() ? &I.masters.masters() : I.shard.active() ? &I.shard_views : nullptr,
      I.shard.active());
  for (size_t p = 0; I.shard.active() && p < I.params.size(); ++p) {
    // Its average exists only in its owners' parts: nobody else could step it.
    TORCH_CHECK(next->holds(static_cast<int>(p)), "GradSync::set_optimizer: parameter '",
                I.names[p], "' is not in the optimizer; with GradSyncOptions::shard it must "
                "hold every parameter GradSync synchronises");
  }
  for (size_t p = 0; I.opts.staleness_ > 0 && p < I.params.size(); ++p) {
    // Its average would sit in the slot the step after next accumulates into.
    TORCH_CHECK(next->steps(static_cast<int>(p)), "GradSync::set_optimizer: parameter '",
                I.names[p], "' is not in the optimizer; with staleness(1) it must step every "
                "parameter GradSync synchronises");
  }
  I.optimizer = std::move(next);
  I.optimizer->plan(I.bucket_params());
  if (I.scaler) detail::ScalerAccess::detach(I.scaler);  // (set_optimizer again)
  I.scaler.reset();
}

void GradSync::set_optimizer(torch::optim::Optimizer& optimizer, GradScaler& scaler) {
  auto& I = *impl_;
  TORCH_CHECK(I.opts.overlap_ != Overlap::None || I.masters.active(), "GradSync::set_optimizer: "
              "with GradSyncOptions::overlap Overlap::None the trainer steps its optimizer: "
              "use scaler.step(optimizer) and scaler.update() after backward (the averaged "
              "gradients are the same on every rank, so every rank skips alike); or choose "
              "Overlap::Optimizer or NextForward to give both to GradSync");
  TORCH_CHECK(I.opts.staleness_ == 0, "GradSync::set_optimizer: a GradScaler does not work with "
              "GradSyncOptions::staleness(1): its look-ahead steps each rank on its own "
              "gradients, before any rank could know whether a step is to be skipped");
  TORCH_CHECK(!I.shard.active(), "GradSync::set_optimizer: a GradScaler with "
              "GradSyncOptions::shard is not supported: each rank sees only its part of the "
              "averages, so whether to skip a step would need an agreement not built yet");
  set_optimizer(optimizer);
  auto handle = detail::ScalerAccess::attach(scaler, &optimizer);
  std::lock_guard<std::mutex> lock(I.mu);
  I.scaler = std::move(handle);
}

std::vector<at::Tensor> GradSync::master_parameters() const {
  impl_->join();
  return impl_->masters.masters();
}

void GradSync::synchronize() {
  auto& I = *impl_;
  if (I.opts.staleness_ > 0) I.drain();
  if (!I.gates) return;
  I.join();
  I.gates->wait_all();
}

void GradSync::wait_ready(const std::vector<at::Tensor>& tensors) {
  if (!impl_->gates) return;
  for (const auto& t : tensors) hooks::wait_gate(t);
}

}  // namespace ddpx
