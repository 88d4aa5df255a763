#pragma once
// GradSync's state and its per-step protocol (private to hooks/): shared by
// grad_sync.cpp (the step's end: agreement, write-back, re-plan) and
// grad_sync_api.cpp (construction and the public methods).
#include <ddpx/grad_sync.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <chrono>
#include <mutex>

#include "hooks/bucket_planner.h"
#include "hooks/channel.h"
#include "hooks/order_predictor.h"
#include "hooks/profiler.h"
#include "hooks/reduce_fn.h"

namespace ddpx {
namespace hooks {

using Clock = std::chrono::steady_clock;
inline double us_since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double, std::micro>(t - t0).count();
}

}  // namespace hooks

struct GradSync::Impl {
  using Clock = hooks::Clock;
  // ---- fixed at construction ------------------------------------------------
  std::vector<std::string> names;
  std::vector<at::Tensor> params;  // requires_grad parameters only
  std::vector<hooks::ParamInfo> info;
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> accumulators;  // keep hooks alive
  std::shared_ptr<std::atomic<Impl*>> alive;  // what the hooks call; null once destroyed
  GradSyncOptions opts;
  std::vector<std::unique_ptr<hooks::Channel>> channels;
  hooks::ReduceFn reduce;
  hooks::WireStatsFn wire_stats;
  std::unique_ptr<hooks::Profiler> profiler;
  int world = 1;

  // ---- the plan (changes only at step boundaries) ---------------------------
  std::vector<hooks::BucketPlan> plan;
  std::vector<at::Tensor> storage;       // flat bucket tensors
  std::vector<int> bucket_of, offset_of;  // per parameter
  std::vector<at::Tensor> views;          // per parameter: its slot, shaped like it
  std::vector<std::string> keys;          // per bucket: the codec's state key
  hooks::OrderPredictor predictor;
  int64_t replans = 0;

  // ---- per-step state, under mu ---------------------------------------------
  std::mutex mu;
  bool active = false;
  std::atomic<bool> no_sync{false};
  std::vector<char> ready;
  std::vector<int> pending;  // per bucket: gradients still missing
  int next_launch = 0;
  std::vector<int> arrival;
  std::vector<std::future<void>> futures;
  std::vector<char> expected_unused;  // Exact: from prepare_for_backward
  StepStats stats, last;
  Clock::time_point t0;
  Clock::time_point agree_t0, agree_t1;  // the step-end agreement, on channel 0
  std::atomic<double> hook_cpu_us{0};

  Impl(GradSyncOptions o, int n) : opts(std::move(o)), predictor(n) {}

  void replan(const std::vector<int>& order) {
    plan = hooks::plan_buckets(order, info,
                               static_cast<int64_t>(opts.first_bucket_mb_ * (1 << 20)),
                               static_cast<int64_t>(opts.bucket_cap_mb_ * (1 << 20)));
    storage.clear();
    keys.clear();
    bucket_of.assign(params.size(), -1);
    offset_of.assign(params.size(), 0);
    views.assign(params.size(), at::Tensor());
    for (size_t b = 0; b < plan.size(); ++b) {
      storage.push_back(at::zeros({plan[b].numel},
                                  at::TensorOptions().dtype(plan[b].dtype).device(plan[b].device)));
      keys.push_back("bucket" + std::to_string(b));
      int64_t off = 0;
      for (int p : plan[b].params) {
        bucket_of[p] = static_cast<int>(b);
        offset_of[p] = static_cast<int>(off);
        // detach(): an alias, not an autograd view; LibTorch's
        // Optimizer::zero_grad calls detach_() on .grad, which views reject.
        views[p] = storage[b].narrow(0, off, info[p].numel).view(params[p].sizes()).detach();
        off += info[p].numel;
      }
    }
  }

  // Is `g` (a parameter's .grad) the bucket slot itself? Then backward has
  // already accumulated into the bucket and there is nothing to copy. After a
  // re-plan, grads still viewing the old storage are not: they are copied.
  bool is_slot(int p, const at::Tensor& g) const {
    return g.defined() && g.data_ptr() == views[p].data_ptr() && g.strides() == views[p].strides();
  }

  // First hook of a backward: reset the step and queue the final callback.
  void begin_step_locked() {
    active = true;
    t0 = Clock::now();
    stats = StepStats{};
    stats.step = last.step + 1;
    ready.assign(params.size(), 0);
    arrival.clear();
    pending.assign(plan.size(), 0);
    for (size_t b = 0; b < plan.size(); ++b) pending[b] = static_cast<int>(plan[b].params.size());
    next_launch = 0;
    futures.clear();
    futures.resize(plan.size());
    stats.buckets.assign(plan.size(), {});
    for (size_t b = 0; b < plan.size(); ++b) {
      stats.buckets[b].index = static_cast<int>(b);
      stats.buckets[b].channel = static_cast<int>(b % channels.size());
      stats.buckets[b].bytes = plan[b].numel * c10::elementSize(plan[b].dtype);
    }
    hook_cpu_us = 0;
    profiler->begin_step(stats.step, t0, static_cast<int>(plan.size()));
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_step(); });
    if (!expected_unused.empty()) {
      for (size_t p = 0; p < params.size(); ++p) {
        if (expected_unused[p]) mark_ready_locked(static_cast<int>(p), /*used=*/false);
      }
    }
  }

  void mark_ready_locked(int p, bool used) {
    if (ready[p]) return;
    ready[p] = 1;
    if (used) {
      arrival.push_back(p);
    } else {
      // A locally unused parameter contributes zeros. If its .grad is the
      // slot, zeroing would clobber it (and a globally unused .grad must stay
      // untouched): give it its own copy first.
      auto& g = params[p].mutable_grad();
      if (is_slot(p, g)) g = g.clone();
      views[p].zero_();
    }
    const int b = bucket_of[p];
    if (--pending[b] == 0) stats.buckets[b].ready_us = hooks::us_since(t0, Clock::now());
    while (next_launch < static_cast<int>(plan.size()) && pending[next_launch] == 0) {
      launch_locked(next_launch++);
    }
  }

  void launch_locked(int b) {
    hooks::Range range("ddpx::bucket_launch");
    auto& bs = stats.buckets[b];
    bs.launch_us = hooks::us_since(t0, Clock::now());
    at::Tensor flat = storage[b];
    const std::string* key = &keys[b];  // keys change only at a re-plan, after every future
    auto* complete = &bs.complete_us;
    const auto start = t0;
    futures[b] = channels[b % channels.size()]->submit(
        [this, flat, key, complete, start, ctx = profiler->launch_context(b)](
            c10d::ProcessGroup& pg) mutable {
          {
            hooks::ReduceScope scope(ctx);
            reduce(flat, *key, pg);
          }
          *complete = hooks::us_since(start, Clock::now());
        });
  }

  void on_grad(int p) {
    if (no_sync.load(std::memory_order_relaxed)) return;
    const auto h0 = Clock::now();
    hooks::Range range("ddpx::hook");
    const at::Tensor& g = params[p].grad();
    // The copy needs no lock: slots are disjoint and the plan only changes at
    // the step boundary, after every hook of the step has run.
    if (g.defined() && !is_slot(p, g)) views[p].copy_(g);
    std::lock_guard<std::mutex> lock(mu);
    if (!active) begin_step_locked();
    if (g.defined()) mark_ready_locked(p, /*used=*/true);
    ++stats.hook_calls;
    const auto h1 = Clock::now();
    hook_cpu_us = hook_cpu_us + hooks::us_since(h0, h1);
    if (profiler->tracing()) profiler->on_hook(bucket_of[p], h0, h1);
  }

  // Would a plan from the updated prediction launch buckets materially
  // earlier under this step's arrival order than the current plan does?
  bool should_replan() const {
    if (!opts.replan_) return false;
    hooks::OrderPredictor next = predictor;
    next.observe(arrival);
    if (next.stable_steps() < 1) return false;  // this order must have repeated
    const int n = static_cast<int>(params.size());
    const auto candidate = hooks::plan_buckets(
        next.predicted_order(), info, static_cast<int64_t>(opts.first_bucket_mb_ * (1 << 20)),
        static_cast<int64_t>(opts.bucket_cap_mb_ * (1 << 20)));
    return hooks::launch_delay(plan, arrival, n) > hooks::launch_delay(candidate, arrival, n) + 0.02;
  }

  void finish_step();
  void flush_trace() {
    channels[0]->submit([this](c10d::ProcessGroup& pg) { profiler->flush(&pg); }).get();
  }
  void write_back(const std::vector<char>& globally_used);
  void replan_agreed(c10d::ProcessGroup& pg);
};


}  // namespace ddpx
