// GradSync: the end of a step (final callback: unused parameters, the
// step-end agreement, write-back, re-planning). The step protocol is in
// grad_sync.h; the state and the hook side are in grad_sync_impl.h.
#include <c10/core/StreamGuard.h>

#include <exception>

#include "hooks/grad_sync_impl.h"
#include "hooks/grad_sync_setup.h"
#include "plugin/comm/flight_triggers.h"

namespace ddpx {

using hooks::us_since;

// A reduction failed: the step ends (a later backward starts a new one) and
// the error is rethrown. Where the transport could not say which peer is gone
// (Gloo, NCCL: "timed out", "connection reset"), the ranks that saw the
// failure ask each other on the group's store, and the answer joins the
// error. A plain c10::Error (bad input, a codec's check) is rethrown as is:
// no peer is to blame, and every rank would wait out the roll call for nothing.
void GradSync::Impl::fail_step(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu);
    active = false;
    clear_declared_locked();
    expected_unused.clear();
    early_used.clear();
  }
  const std::string what = comm::detail::backend_failure_text(error);
  comm::detail::fr_dump_after_failure("GradSync: step " + std::to_string(stats.step) + " failed");
  const std::string who = comm::roll_call(channels[0]->pg(), stats.step);
  if (who.empty()) std::rethrow_exception(error);
  C10_THROW_ERROR(DistBackendError, "GradSync: step " + std::to_string(stats.step) + " of " +
                                        comm::process_label() + " failed: " + what +
                                        "\nGradSync: asked on the store: " + who);
}

void GradSync::Impl::finish_step() {
  hooks::Range range("ddpx::final_callback");
  const auto f0 = stale_f0 ? *stale_f0 : Clock::now();
  stale_f0.reset();
  std::vector<std::string> missing;
  {
    std::unique_lock<std::mutex> lock(mu);
    if (declare_error) {  // held since the first hook, alike on every rank
      const auto error = declare_error;
      lock.unlock();
      fail_step(error);
    }
    stats.backward_us = us_since(t0, f0);
    for (size_t p = 0; p < params.size(); ++p) {
      if (ready[p]) continue;
      if (opts.unused_ == Unused::Off) {
        missing.push_back(names[p]);
      } else {
        if (!predictor.predicted_unused(static_cast<int>(p))) ++stats.unused_mispredictions;
        mark_ready_locked(static_cast<int>(p), /*used=*/false);
      }
    }
    if (!missing.empty()) {
      active = false;
      clear_declared_locked();
      // Buckets already launched must finish before the storage is reused.
      for (auto& f : futures) if (f.valid()) f.wait();
      for (auto& f : rest_futures)
        if (f.valid()) f.wait();
      for (auto& f : gathers)  // (sharded steps during backward: steps_early)
        if (f.valid()) f.wait();
      if (early_pending && early_pending->stepped.valid()) early_pending->stepped.wait();
      early_pending.reset();
      block_on_reductions();
      std::string list;
      for (size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", " : "") + missing[i];
      TORCH_CHECK(false, "GradSync: ", missing.size(), " parameter(s) received no gradient in "
                  "this backward (", list, missing.size() > 8 ? ", ..." : "",
                  "); with unused parameters use GradSyncOptions().unused(Unused::Predict) or "
                  "Unused::Exact. The other ranks will time out waiting for this one.");
    }
    launch_held_locked();
    queue_early_gather_locked();  // (the last early bucket's: before the agreement)
    // Read by mark_ready_locked above; the next no_sync backward may set
    // them again while this step completes on the worker.
    for (size_t p = 0; p < params.size(); ++p) {
      accumulated[p].store(false, std::memory_order_relaxed);
    }
  }
  // Step-end agreement on channel 0, after every reliable bucket (a late one
  // goes after it): which parameters were used anywhere (MAX of local
  // flags), and rank 0's re-plan proposal.
  const int n = static_cast<int>(params.size());
  const bool propose = should_replan();
  // [used here (n): 1 + the gradient's sparse_dim (0: dense) | rank 0's
  //  proposal | a surprise gradient | unused here (n) | -(the last
  //  agreement's round trip here, us) | rank 0's priority verdict]
  auto flags = at::zeros({2 * n + 4}, at::kInt);
  used_here.assign(n, 0);
  {
    auto* f = flags.data_ptr<int>();
    for (int p : arrival) f[p] = 1 + sparse_dim[p];
    for (int p : carried) f[p] = 1 + sparse_dim[p];
    for (int p = 0; p < n; ++p) used_here[p] = f[p] != 0;
    f[n] = propose && channels[0]->pg().getRank() == 0 ? 1 : 0;  // only rank 0's counts
    f[n + 1] = surprises.empty() && declared_surprises.empty() ? 0 : 1;
    // (Declared unused: not a miss, so never late for it.)
    for (int p = 0; p < n; ++p) f[n + 2 + p] = f[p] || declared[p] ? 0 : 1;
    // MAX of the negated trips: the least over ranks, the one of the rank
    // that arrived last, which did not wait for the others (skew).
    f[2 * n + 2] = last_trip_us < 0 ? kNoTrip
                                    : -static_cast<int>(std::min(last_trip_us, 1e9));
    // Priority, measured: the step's period shows the last step's launch
    // order (priority_trial.h); only rank 0's measurements count.
    if (prioritised() && channels[0]->pg().getRank() == 0) {
      if (last_end) priority_trial.observe(stats.step, us_since(*last_end, f0));
      last_end = f0;
      f[2 * n + 3] = priority_trial.verdict(stats.step);
    }
  }
  end_flags = flags;
  end_agree = agree_max(flags, "ddpx::step_agreement", &agree_t0, &agree_t1,
                        /*record_step=*/true);
  end_f0 = f0;
  end_cpu_us = us_since(f0, Clock::now());
  step_stale = stale_now();
  stats.stale = step_stale;
  ++synced_steps;
  // From here complete_step runs, and updates the scale or, failing, lets it
  // be: the trainer's next scaler.scale() waits until then (begin_step_locked
  // checked that the loss was scaled).
  if (scaler && optimizer && detail::ScalerAccess::enabled(scaler)) {
    scaler_inv = detail::ScalerAccess::begin_step(scaler);
  }
  if (!gates && !step_stale) {
    complete_step();
    return;
  }
  // NextForward: backward returns now; each parameter's gate opens when its
  // update has landed. Stale: the update waits for the next backward's end.
  if (gates) gates->close_all();
  // Device buckets: the worker queues the step's device work (the waits for
  // the reductions, the updates) on this thread's streams, the ones the
  // trainer's next forward and optimizer run on.
  completing = worker->submit(
      [this, consumer = hooks::current_streams(plan_devices())](c10d::ProcessGroup&) {
        c10::MultiStreamGuard on_consumer(consumer);
        try {
          complete_step();
        } catch (...) {
          completion_error = std::current_exception();
          {
            std::lock_guard<std::mutex> lock(mu);
            active = false;
          }
          if (gates) gates->fail(completion_error);
        }
      });
}

void GradSync::Impl::block_on_reductions() {
  // Device buckets: what runs after backward on this thread's streams (the
  // caller's, as autograd sets them for final callbacks), the optimizer
  // among it, runs after the reductions. A failed step's too: a trainer
  // that catches the error and goes on writes the slots in its next
  // backward, which the reductions' copies back may still be writing.
  for (size_t b = 0; b < reduced.size(); ++b) {
    if (!reduced[b]) continue;
    const auto here = hooks::current_stream(plan[b].device);
    reduced[b]->block(here);
    // A sparse average, made on the channel's stream, becomes .grad here.
    if (plan[b].sparse) hooks::mark_in_use(sparse_out[plan[b].params.front()], here);
  }
}

std::exception_ptr GradSync::Impl::surprise_error() {
  auto list = [this](const std::vector<int>& ps) {
    std::string out;
    for (size_t i = 0; i < ps.size() && i < 8; ++i) out += (i ? ", '" : "'") + names[ps[i]] + "'";
    return out.empty() ? std::string("none; on another rank") : out;
  };
  std::lock_guard<std::mutex> lock(mu);
  const bool declared_here = !declared_surprises.empty();
  const std::string here = list(declared_here ? declared_surprises : surprises);
  try {
    TORCH_CHECK(!declared_here, "GradSync: parameter(s) declared unused for this step "
                "(declare_unused) received a gradient (on this rank: ", here, "); its "
                "gradient was not averaged. Declare only what the step's forward skips");
    TORCH_CHECK(false, "GradSync: a parameter received a gradient, but the outputs given to "
                "prepare_for_backward do not reach it (on this rank: ", here, "); pass every "
                "output that backward starts from (or, if it was declared unused on another "
                "rank, declare only what the forward skips)");
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

void GradSync::Impl::complete_step() {
  const auto c0 = Clock::now();
  const int n = static_cast<int>(params.size());
  const at::Tensor flags = end_flags;
  std::future<void> agree = std::move(end_agree);
  std::exception_ptr error;
  auto take = [&error](std::future<void>& f) {
    try {
      if (f.valid()) f.get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  };
  // The agreement, awaited once. A surprise gradient (Exact, declare_unused)
  // it flags fails the step on every rank, before any update.
  bool agreed = false;
  double agree_wait_us = 0;  // not our CPU: waiting for the wire
  auto settle = [&] {
    if (agreed) return;
    const auto a0 = Clock::now();
    take(agree);
    agree_wait_us += us_since(a0, Clock::now());
    agreed = true;
    if (!error && flags.const_data_ptr<int>()[n + 1] != 0) error = surprise_error();
  };
  // Late buckets go after the agreement, without the slots of parameters
  // that no rank used: every rank launches the same runs in the same order.
  const int n_buckets = static_cast<int>(plan.size());
  if (next_launch < n_buckets) {
    settle();
    if (!error) {
      std::vector<char> anywhere(n);
      const int* fl = flags.const_data_ptr<int>();
      for (int p = 0; p < n; ++p) anywhere[p] = fl[p] != 0;
      std::lock_guard<std::mutex> lock(mu);
      // Used elsewhere, not here: this rank's contribution is zeros. (.grad,
      // if it is the slot, becomes the average at write-back anyway.)
      for (int p : idle_late) {
        if (!anywhere[p]) continue;
        if (transient_storage()) ensure_storage(bucket_of[p]);
        views[p].zero_();
      }
      for (; next_launch < n_buckets; ++next_launch) launch_bucket_locked(next_launch, anywhere);
      launch_rest_locked();  // (a cut bucket that only went out here: its remainder too)
    }
  }
  const auto wait0 = Clock::now();
  const double cpu_before_wait = end_cpu_us + us_since(c0, wait0) - agree_wait_us;
  hooks::Range wait_range("ddpx::final_wait");
  // With an optimizer, each bucket is stepped as it lands (in plan order),
  // while later ones are still on the wire.
  // (In launch order: held buckets went first layer first.)
  // A bucket cut by priority lands after the held ones that overtook its
  // remainder: it goes last, so their updates are not held up behind it.
  std::vector<int> seq;
  for (int b : launch_seq) {
    if (!rest_futures[b].valid()) seq.push_back(b);
  }
  for (int b : launch_seq) {
    if (rest_futures[b].valid()) seq.push_back(b);
  }
  for (int b = 0; b < n_buckets; ++b) {
    if (std::find(seq.begin(), seq.end(), b) == seq.end()) seq.push_back(b);
  }
  // Under a GradScaler each average is unscaled as it lands, and whether to
  // step is known only once every one has (scaled_step).
  const bool scaled = optimizer && scaler && !step_stale;
  // So does global-norm clipping (GradSyncOptions::clip_grad_norm).
  const bool clipped = optimizer && opts.clip_grad_norm_ > 0 && !step_stale;
  const bool deferred = scaled || clipped;
  std::vector<std::vector<int>> landed(deferred ? n_buckets : 0);
  amp::FoundInf found;
  // Sharded: the buckets stepped, in the order their gathers go. Under
  // NextForward the gathers wait for the last step and go first layer first
  // (reverse launch order), so the next forward's first gates open after
  // one gather, not after all of them.
  std::vector<int> gather_seq;
  auto gather = [&](int b) {
    if (!gates) gather_sharded(b);
    gather_seq.push_back(b);
  };
  for (int b : seq) {
    take(futures[b]);
    take(rest_futures[b]);
    if (!optimizer || error || step_stale) continue;
    if (gathers[b].valid()) {  // stepped and gathered during backward (steps_early)
      gather_seq.push_back(b);
      continue;
    }
    if (needs_agreement(b)) settle();
    if (error) continue;
    const int* agreed_flags = agreed ? flags.const_data_ptr<int>() : nullptr;
    if (!deferred) {
      if (!shard.active()) {
        apply_bucket(b, agreed_flags);
        continue;
      }
      try {
        step_sharded(b, land_sharded(b, agreed_flags));
        gather(b);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
      continue;
    }
    try {
      landed[b] = shard.active() ? land_sharded(b, agreed_flags)
                                 : land_bucket(b, agreed_flags, /*stale=*/false);
      if (!scaled || !scaler_inv.defined()) continue;  // (a disabled scaler: nothing to unscale)
      std::vector<at::Tensor> grads;
      for (int p : landed[b]) grads.push_back(stepped_tensor(p));
      amp::unscale_grads(grads, scaler_inv, found, /*allow_fp16=*/false, "GradSync");
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  settle();
  if (deferred && !error) {
    try {
      if (clipped) clip_landed(landed);  // (scaled: the unscaled averages)
      if (scaled) {
        scaled_step(seq, landed, found);
      } else {
        for (int b : seq) {
          if (shard.active()) {
            step_sharded(b, landed[b]);
            gather(b);
          } else {
            step_bucket(b, landed[b], /*stale=*/false, /*skip=*/false);
          }
        }
      }
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (gates) {
    std::reverse(gather_seq.begin(), gather_seq.end());
    for (int b : gather_seq) {
      try {
        gather_sharded(b);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
  }
  // Sharded: the gathers landing; each bucket's parameters then hold the
  // update (and, NextForward, their gates open).
  for (int b : gather_seq) {
    if (!gathers[b].valid()) continue;
    take(gathers[b]);
    if (error) continue;
    try {
      finish_sharded(b);
    } catch (...) {
      error = std::current_exception();
    }
  }
  wait_range.end();
  if (error) {
    // Sharded steps already queued on the channels (steps_early) write the
    // parameters: they end before the step fails.
    for (auto& g : gathers) {
      if (g.valid()) g.wait();
    }
  }
  if (scaler && scaler_inv.defined() && error) {
    detail::ScalerAccess::finish_step(scaler, at::Tensor());  // no verdict: the scale stays
  }
  scaler_inv = at::Tensor();
  block_on_reductions();
  if (error) fail_step(error);
  const auto w0 = Clock::now();
  std::vector<char> used(n);
  const int* fl = flags.const_data_ptr<int>();
  for (int p = 0; p < n; ++p) used[p] = fl[p] != 0;
  if (!optimizer) write_back(used);  // (else each bucket's update did it)
  // Lateness follows "unused on some rank", the same on every rank, so each
  // rank decides alike whether the late set changed (no vote needed).
  const std::vector<char> missed(fl + n + 2, fl + 2 * n + 2);
  predictor.observe(arrival, &missed, &arrival_us, &declared);
  used_anywhere.observe(used);
  learn_link_rate(fl[2 * n + 2] == kNoTrip ? -1.0 : -static_cast<double>(fl[2 * n + 2]));
  last_trip_us = us_since(agree_t0, agree_t1);
  const bool late_changed =
      opts.replan_ && late_for(predictor) != plan_late && predictor.late_stable_steps() >= 1;
  for (size_t b = 0; b < plan.size(); ++b) {  // (before a re-plan changes the plan)
    if (plan[b].sparse) sparse_bytes += stats.buckets[b].bytes;
  }
  const bool sparse_changed = opts.replan_ && learn_sparse(fl);
  if (prioritised()) priority_trial.settle(stats.step, fl[2 * n + 3]);
  if (fl[n] != 0 || late_changed || sparse_changed) replan_agreed(channels[0]->pg());
  // Rank 0's buffers for the next forward (DDP does this before each
  // forward; nothing changes buffers in between). Waiting for the wire here
  // is exposed communication, not our CPU.
  double buffers_us = 0;
  // (A stale step broadcasts them in its final callback: the next forward
  // is running by now.)
  if (opts.broadcast_buffers_ && world > 1 && !buffers.empty() && !step_stale) {
    const auto b0 = Clock::now();
    try {
      hooks::Range r("ddpx::broadcast_buffers");
      hooks::broadcast_from_rank0(channels[0]->pg(), buffers);
    } catch (...) {
      fail_step(std::current_exception());
    }
    buffers_us = us_since(b0, Clock::now());
  }
  if (gates) {
    // The buffers' (and any parameter left: sparse, unused); on a device,
    // after the work queued here (the broadcast, the write-back).
    gates->open_all(hooks::fence_current(plan_devices()));
  }

  std::lock_guard<std::mutex> lock(mu);
  const auto f1 = Clock::now();
  const auto f0 = end_f0;
  stats.exposed_comm_us = gates || step_stale ? end_cpu_us : us_since(f0, f1);
  for (const auto& b : stats.buckets) {
    stats.comm_us += b.complete_us - b.launch_us;
    if (b.gathered_us >= 0) stats.comm_us += b.gathered_us - b.gather_us;
    stats.bytes_reduced += b.bytes;
  }
  // Our CPU: the hooks, the final callback up to its wait, and the write-back.
  stats.hook_cpu_us = hook_cpu_us + cpu_before_wait + us_since(w0, f1) - buffers_us;
  stats.per_param_hooks_us = hook_cpu_us - begin_us;
  stats.memory_wait_us = static_cast<double>(memory_wait_ns.exchange(0)) / 1e3;
  stats.memory_waits = memory_waits.exchange(0);
  stats.replans = replans;
  last = stats;
  last_storage_peak = storage_peak.load();
  auto wire = wire_stats();  // the codec's traffic, and the sparse rows (uncompressed)
  wire.bytes_sent += sparse_bytes + shard_bytes;
  wire.bytes_raw += sparse_bytes + shard_raw;
  profiler->end_step(stats, {t0, f0, wait0, w0, f1, agree_t0, agree_t1}, hook_cpu_us, wire);
  expected_unused.clear();
  early_used.clear();
  clear_declared_locked();
  if (step_stale) {
    stale_used.assign(fl, fl + n);
    stale_pending = true;
  }
  active = false;
  if (profiler->flush_due()) flush_trace();  // the first step after the window
}

void GradSync::Impl::write_back(const std::vector<char>& globally_used) {
  at::NoGradGuard no_grad;
  for (size_t p = 0; p < params.size(); ++p) {
    write_back_param(static_cast<int>(p), globally_used[p] != 0);
  }
}

void GradSync::Impl::write_back_param(int p, bool globally_used) {
  if (info[p].sparse) sparse_in[p] = at::Tensor();  // reduced: not ours to keep
  if (!globally_used) {
    // Unused everywhere: .grad untouched, as under DDP. In a reliable
    // bucket its slot was sent all the same, carrying the codec's residual
    // for it; the mean of what the ranks sent is owed again, so error
    // feedback loses nothing (over the ranks, the sum is conserved).
    // (A declared one's slot was not sent: it owes nothing new.)
    if (lossy && !plan[bucket_of[p]].late && !info[p].sparse && !declared[p]) {
      owe(p, views[p]);
    }
    return;
  }
  if (info[p].sparse) {
    if (sparse_out[p].defined()) params[p].mutable_grad() = std::move(sparse_out[p]);
    return;
  }
  // The average goes to the .grad of what the optimizer steps: the
  // parameter, or (mixed precision) its float32 master, whose .grad is
  // then the slot if the bucket is float32 too, else a float32 copy.
  const at::Tensor& target = stepped_tensor(p);
  if (!masters.active() && opts.gradient_as_bucket_view_ && grad_in_slot[p]) {
    return;  // the average is there
  }
  auto& g = target.mutable_grad();
  const at::ScalarType dtype = target.scalar_type();
  if (sparse_dim[p] > 0 && !masters.active()) {
    g = views[p].to_sparse(sparse_dim[p]).to(dtype);  // the average's nonzero rows
  } else if (opts.gradient_as_bucket_view_ && views[p].scalar_type() == dtype) {
    // .grad becomes the slot (DDP's gradient_as_bucket_view): the average
    // is already there, and the next backward accumulates into the bucket.
    if (!is_slot(p, g)) g = views[p];
  } else if (g.defined() && g.scalar_type() == dtype && !g.is_sparse() && !is_slot(p, g)) {
    g.copy_(views[p]);
  } else {
    g = views[p].to(dtype, /*non_blocking=*/false, /*copy=*/true);
  }
  // Mixed precision with buckets in param_dtype: the parameter's own .grad
  // becomes its slot too, so the next backward accumulates into the bucket.
  if (masters.active() && opts.gradient_as_bucket_view_ &&
      views[p].scalar_type() == params[p].scalar_type() && !is_slot(p, params[p].grad())) {
    params[p].mutable_grad() = views[p];
  }
}

}  // namespace ddpx
