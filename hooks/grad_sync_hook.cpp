// GradSync's per-parameter path, run by backward: a gradient hook brings the
// gradient into its bucket (or, sparse, references it), marks it ready, and
// launches the buckets that are complete, in plan order; the first hook of a
// step starts it (grad_sync_impl.h has the state and the protocol).
#include "hooks/grad_sync_impl.h"

namespace ddpx {

std::future<void> GradSync::Impl::agree_max(at::Tensor flags, const char* range,
                                            Clock::time_point* t0, Clock::time_point* t1,
                                            bool record_step) {
  std::function<void(c10d::ProcessGroup&)> body = [flags, range, t0,
                                                   t1](c10d::ProcessGroup& pg) mutable {
    hooks::Range r(range);
    if (t0) *t0 = Clock::now();
    std::vector<at::Tensor> t{flags};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    comm::detail::wait_named(pg.allreduce(t, o));
    if (t1) *t1 = Clock::now();
  };
  if (record_step) {  // (called without the lock: the step's final callback)
    const std::lock_guard<std::mutex> lock(mu);
    comm::detail::FlightRecorder::Call call;
    call.op = comm::detail::FrOp::kAllReduce;
    call.dtype = flags.scalar_type();
    call.numel = flags.numel();
    call.step = stats.step;
    body = recorded_locked(call, std::move(body));
  }
  return channels[0]->submit(std::move(body));
}

bool GradSync::Impl::is_slot(int p, const at::Tensor& g) const {
  // Write-back makes .grad share the slot's TensorImpl: comparing pointers
  // first spares the hook two reads of tensor metadata, which after a
  // large kernel are cache (and TLB) misses.
  if (!g.defined() || !views[p].defined()) return false;
  if (g.unsafeGetTensorImpl() == views[p].unsafeGetTensorImpl()) return true;
  return g.layout() == at::kStrided && g.data_ptr() == views[p].data_ptr() &&
         g.strides() == views[p].strides();
}

void GradSync::Impl::copy_to_slot(int p, const at::Tensor& g) {
  // at::internal::GRAIN_SIZE (TensorIterator.h): above it copy_ goes parallel.
  constexpr int64_t kMemcpyMaxNumel = 32768;
  at::Tensor& slot = views[p];
  if (g.is_cpu() && slot.is_cpu() && g.layout() == at::kStrided && g.has_storage() &&
      g.scalar_type() == slot.scalar_type() && g.numel() <= kMemcpyMaxNumel &&
      g.sizes() == slot.sizes() && g.is_contiguous() && !g.is_conj() && !g.is_neg() &&
      !g._is_zerotensor()) {
    const size_t n = g.nbytes();
    auto* dst = static_cast<char*>(slot.data_ptr());
    const auto* src = static_cast<const char*>(g.const_data_ptr());
    if (src + n <= dst || dst + n <= src) {
      if (n > 0) std::memcpy(dst, src, n);
      slot.unsafeGetTensorImpl()->bump_version();  // as an in-place copy_ would
      return;
    }
  }
  if (g.is_sparse()) {
    slot.zero_().add_(g);  // dense += sparse: no dense temporary
    return;
  }
  TORCH_CHECK(g.layout() == at::kStrided, "GradSync: parameter '", names[p],
              "' got a gradient of layout ", g.layout(),
              "; GradSync reduces strided and sparse COO gradients");
  slot.copy_(g);
}

bool GradSync::Impl::gather_grad(int p, const at::Tensor& g) {
  if (info[p].sparse) {
    TORCH_CHECK(g.layout() == at::kStrided || g.is_sparse(), "GradSync: parameter '", names[p],
                "' got a gradient of layout ", g.layout(),
                "; GradSync reduces strided and sparse COO gradients");
    sparse_dim[p] = g.is_sparse() ? static_cast<int8_t>(g.sparse_dim()) : 0;
    sparse_in[p] = g;  // read by its reduction; backward will not touch it again
    return false;
  }
  if (is_slot(p, g)) {
    sparse_dim[p] = 0;
    return true;
  }
  sparse_dim[p] = g.is_sparse() ? static_cast<int8_t>(g.sparse_dim()) : 0;
  TORCH_CHECK(!shard.active() || !g.is_sparse(), "GradSync: parameter '", names[p],
              "' got a sparse gradient; GradSyncOptions::shard reduces dense gradients only");
  if (transient_storage()) ensure_storage(bucket_of[p]);
  copy_to_slot(p, g);
  return false;
}

void GradSync::Impl::begin_step_locked(const Clock::time_point* replay_start) {
  TORCH_CHECK(opts.overlap_ == Overlap::None || optimizer, "GradSync: GradSyncOptions::overlap "
              "is ", opts.overlap_ == Overlap::Optimizer ? "Optimizer" : "NextForward",
              ", which steps the optimizer bucket by bucket: give it with set_optimizer before "
              "the first backward");
  TORCH_CHECK(!masters.active() || optimizer, "GradSync: GradSyncOptions::mixed_precision keeps "
              "float32 masters of the parameters, which only GradSync can step: give the "
              "optimizer with set_optimizer before the first backward");
  TORCH_CHECK(!shard.active() || optimizer, "GradSync: GradSyncOptions::shard leaves each rank "
              "the average of its own part only, which only GradSync can step: give the "
              "optimizer with set_optimizer before the first backward");
  TORCH_CHECK(opts.clip_grad_norm_ == 0 || optimizer, "GradSync: GradSyncOptions::"
              "clip_grad_norm clips where GradSync steps the optimizer: give it with "
              "set_optimizer, or call torch::nn::utils::clip_grad_norm_ after backward");
  if (scaler && detail::ScalerAccess::enabled(scaler)) detail::ScalerAccess::check_started(scaler);
  active = true;
  t0 = replay_start ? *replay_start : Clock::now();
  stats = StepStats{};
  stats.step = last.step + 1;
  stats.skipped_steps = last.skipped_steps;
  if (optimizer) optimizer->snapshot();  // this step's options: a schedule moves on meanwhile
  if (gates) std::tie(stats.gate_wait_us, stats.gate_waits) = gates->take_waits();
  ready.assign(params.size(), 0);
  grad_in_slot.assign(params.size(), 0);
  arrival.clear();
  arrival_us.assign(params.size(), -1.0);
  idle_late.clear();
  carried.clear();
  surprises.clear();
  pending.assign(plan.size(), 0);
  for (size_t b = 0; b < plan.size(); ++b) pending[b] = static_cast<int>(plan[b].params.size());
  next_launch = 0;
  launch_seq.clear();
  futures.clear();
  futures.resize(plan.size());
  gathers.clear();
  gathers.resize(plan.size());
  owned_grads.assign(plan.size(), at::Tensor());
  owned_in_bucket.assign(plan.size(), 0);
  storage_peak = storage_bytes.load();
  rest_futures.clear();
  rest_futures.resize(plan.size());
  split_sent = -1;
  wrote_on.assign(plan.size(), {});
  reduced.assign(plan.size(), nullptr);
  stats.buckets.assign(plan.size(), {});
  for (const auto& b : plan) stats.held_planned += b.held ? 1 : 0;
  priority_now = prioritised() && priority_trial.begin(stats.step, stats.held_planned > 0);
  stats.priority_on = priority_now;
  for (size_t b = 0; b < plan.size(); ++b) {
    stats.buckets[b].index = static_cast<int>(b);
    stats.buckets[b].channel = static_cast<int>(b % channels.size());
    stats.buckets[b].bytes = plan[b].numel * c10::elementSize(plan[b].dtype);
    stats.buckets[b].held = plan[b].held && priority_now;
  }
  hook_cpu_us = 0;
  profiler->begin_step(stats.step, t0, static_cast<int>(plan.size()));
  if (!replay_start) {
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_step(); });
  }
  skipped_in.assign(plan.size(), 0);
  declared_surprises.clear();
  declare_error = nullptr;
  if (declare_check.valid()) settle_declared_locked();
  if (!expected_unused.empty()) {
    for (size_t p = 0; p < params.size(); ++p) {
      if (expected_unused[p]) mark_ready_locked(static_cast<int>(p), /*used=*/false);
    }
  }
}

void GradSync::Impl::settle_declared_locked() {
  try {
    declare_check.get();
    const int64_t* m = declare_msg.const_data_ptr<int64_t>();
    TORCH_CHECK(m[2] == 0, "GradSync: step ", stats.step, ": a parameter declared unused "
                "(declare_unused) holds a gradient accumulated under no_sync on some rank; "
                "declare only what no micro-batch of the step used");
    TORCH_CHECK(m[0] == -m[1], "GradSync: step ", stats.step, ": the ranks declared different "
                "parameters unused (declare_unused); a drop pattern must be the same on every "
                "rank (drawn from a shared seed and the step), or not declared at all");
  } catch (...) {
    // Held: nothing launches, every rank ends the step in the error.
    declare_error = std::current_exception();
    return;
  }
  for (size_t p = 0; p < params.size(); ++p) {
    if (!declared[p]) continue;
    // No gradient, no zeros, no residual: its slot stays off the wire and
    // its .grad untouched (as for a parameter unused on every rank).
    ready[p] = 1;
    const int b = bucket_of[p];
    ++skipped_in[b];
    if (--pending[b] == 0) stats.buckets[b].ready_us = 0;
  }
  launch_ready_locked();
}

void GradSync::Impl::clear_declared_locked() {
  if (n_declared > 0) std::fill(declared.begin(), declared.end(), 0);
  n_declared = 0;
  declare_error = nullptr;
}

void GradSync::Impl::note_writer_locked(int b) {
  const c10::Device d = plan[b].device;
  if (!hooks::has_streams(d)) return;
  const c10::Stream s = hooks::current_stream(d);
  auto& w = wrote_on[b];
  if (std::find(w.begin(), w.end(), s) == w.end()) w.push_back(s);
}

void GradSync::Impl::mark_ready_locked(int p, bool used) {
  note_writer_locked(bucket_of[p]);  // the hook's copy, or the zeroing below
  if (ready[p]) return;
  ready[p] = 1;
  if (transient_storage()) ensure_storage(bucket_of[p]);
  if (used) {
    arrival.push_back(p);
    arrival_us[p] = hooks::us_since(t0, Clock::now());
  } else if (accumulated[p].load(std::memory_order_relaxed) && params[p].grad().defined()) {
    // Not in this backward, but its no_sync micro-batches left a gradient:
    // that is this rank's contribution (and it counts as used).
    gather_grad(p, params[p].grad());
    carried.push_back(p);
  } else if (info[p].sparse) {
    // Sends no rows; its reduction tells the ranks whether any rank had
    // some. (Not reset when a step starts: the hook that starts it may
    // have just gathered its gradient.)
    sparse_in[p] = at::Tensor();
  } else if (plan[bucket_of[p]].late) {
    // Its slot goes on the wire only if some rank used it: zeroed then
    // (now if that is known, else in finish_step after the agreement),
    // else neither sent nor touched, so no copy.
    if (early_used.empty()) {
      idle_late.push_back(p);
    } else if (early_used[p]) {
      views[p].zero_();
    }
  } else {
    // A locally unused parameter contributes zeros. If its .grad is the
    // slot, zeroing would clobber it (and a globally unused .grad must stay
    // untouched): give it its own copy first. Unless the slot holds zeros
    // already (zero_grad in place) and the codec is exact: then a globally
    // unused slot comes back as zeros, .grad untouched, and nothing is
    // copied (a lossy codec may send residuals into it). CPU only: on a
    // device, reading "any" would wait for the stream; the copy does not.
    auto& g = params[p].mutable_grad();
    const bool slot = is_slot(p, g);
    if (!slot || lossy || !g.is_cpu() || g.any().item<bool>()) {
      if (slot) g = g.clone();
      views[p].zero_();
    }
  }
  const int b = bucket_of[p];
  if (--pending[b] == 0) stats.buckets[b].ready_us = hooks::us_since(t0, Clock::now());
  launch_ready_locked();
}

void GradSync::Impl::launch_ready_locked() {
  if (declare_error) return;  // the step fails on every rank: nothing goes out
  // Late buckets wait for the used-parameter agreement: from
  // prepare_for_backward (Exact), else finish_step's. Under Predict they
  // come after every reliable bucket in the plan; under Exact, where their
  // gradients usually arrive (order_of).
  // Held buckets (priority) wait for the final callback.
  while (next_launch < static_cast<int>(plan.size()) && pending[next_launch] == 0 &&
         !(plan[next_launch].held && priority_now) &&
         (!plan[next_launch].late || !early_used.empty())) {
    launch_bucket_locked(next_launch++, early_used);
  }
}

void GradSync::Impl::launch_held_locked() {
  if (declare_error) return;
  if (!priority_now) {  // first in, first out: launched as they filled
    launch_ready_locked();
    return;
  }
  // The buckets before the held ones first (in plan order, on every rank:
  // a cut bucket's first part among them), then the held ones first layer
  // first, then the cut bucket's remainder they overtook.
  launch_ready_locked();
  const int n = static_cast<int>(plan.size());
  int end = next_launch;
  while (end < n && plan[end].held && pending[end] == 0) ++end;
  for (int b = end - 1; b >= next_launch; --b) launch_bucket_locked(b, early_used);
  next_launch = end;
  launch_rest_locked();
  launch_ready_locked();
}

void GradSync::Impl::launch_bucket_locked(int b, const std::vector<char>& anywhere) {
  launch_seq.push_back(b);
  if (shard.active()) {
    launch_sharded_locked(b, anywhere);  // whole: unused and declared slots too
    return;
  }
  if (!plan[b].late && skipped_in[b] == 0) {
    // Cut by priority: its remainder goes after the held buckets
    // (launch_held_locked); every rank cuts alike (the plan and
    // priority_now are agreed, skipped_in compared).
    if (plan[b].held_from > 0 && priority_now) {
      launch_locked(b, {{0, plan[b].held_from}});
      split_sent = b;
      return;
    }
    launch_locked(b);
    return;
  }
  // (A sparse bucket holds one parameter: skipped means nothing to send.)
  auto runs = plan[b].sparse ? std::vector<Run>{} : sent_runs(b, anywhere);
  if (!runs.empty()) {
    launch_locked(b, std::move(runs));
    return;
  }
  auto& bs = stats.buckets[b];
  bs.launch_us = bs.complete_us = hooks::us_since(t0, Clock::now());
  bs.bytes = 0;
}

void GradSync::Impl::on_grad(int p) {
  if (no_sync.load(std::memory_order_relaxed)) {
    accumulated[p].store(true, std::memory_order_relaxed);
    return;
  }
  if (stale_now()) {
    on_stale_grad(p);  // the rest runs in the step's final callback (finish_stale)
    return;
  }
  if (gates) {
    // NextForward: the last step must be complete (its buckets free) and
    // this parameter must have been read through its gate.
    if (completing.valid()) join();
    TORCH_CHECK(gates->passed(p), "GradSync: parameter '", names[p], "' was read by the "
                "forward without waiting for its update from the last step "
                "(Overlap::NextForward), so the forward may have seen it half-updated; gate "
                "each layer's parameters with GradSync::wait_ready (a scripted model is gated "
                "by GradSync's graph pass if GradSync is made before its first forward), or "
                "call synchronize() before the forward");
  }
  const auto h0 = Clock::now();
  hooks::Range range("ddpx::hook");
  const at::Tensor g = params[p].grad();  // (a copy: Shard::Gradients resets .grad below)
  // Declared unused, yet here: neither copied nor sent (its slot may be
  // off the wire), an error at the step's end on every rank. The same for
  // one that prepare_for_backward's outputs do not reach (Exact): it was
  // marked ready unused when the step began, so its slot may be on the wire
  // already (zeroed, if another rank uses it) -- copying into it would race
  // the send (ThreadSanitizer found that).
  const bool skip = declared[p] != 0;
  const bool surprise = !skip && !expected_unused.empty() && expected_unused[p];
  // The copy needs no lock: slots (and sparse_dim entries) are per
  // parameter, and the plan only changes at the step boundary, after every
  // hook of the step has run.
  if (g.defined() && !skip && !surprise && transient_storage()) make_room(bucket_of[p]);
  const bool in_slot = g.defined() && !skip && !surprise && gather_grad(p, g);
  // Shard::Gradients: the gradient's memory goes once it is in the bucket.
  if (g.defined() && !in_slot && !skip && !surprise && transient_storage()) {
    params[p].mutable_grad() = at::Tensor();
  }
  std::lock_guard<std::mutex> lock(mu);
  if (!active) {
    begin_step_locked();
    begin_us = hooks::us_since(h0, Clock::now());  // per step, not per parameter
  }
  grad_in_slot[p] = in_slot ? 1 : 0;
  if (skip) {
    if (g.defined()) declared_surprises.push_back(p);
  } else if (g.defined() && surprise) {
    surprises.push_back(p);  // an error at the step's end, on every rank
  }
  if (g.defined() && !skip && !surprise) mark_ready_locked(p, /*used=*/true);
  ++stats.hook_calls;
  const auto h1 = Clock::now();
  hook_cpu_us = hook_cpu_us + hooks::us_since(h0, h1);
  if (profiler->tracing()) profiler->on_hook(bucket_of[p], h0, h1);
}

}  // namespace ddpx
