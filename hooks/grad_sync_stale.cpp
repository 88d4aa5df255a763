// GradSync one step stale (GradSyncOptions::staleness(1)): step t's
// reductions run during step t+1 and its update lands at the end of step
// t+1's backward. The per-step machinery is the synchronous one, shifted.
// While step t completes on the worker (its waits, agreement and learning
// use the per-step state), step t+1's hooks only note which gradients
// arrived and when; its final callback waits for step t, applies step t's
// update from the set of bucket tensors in flight, swaps the two sets and
// replays the arrivals through the usual path (grad_sync_hook.cpp), which
// launches every bucket and hands step t+1 to the worker. With
// stale_lookahead, before the replay each rank also steps the parameters
// once more on its own gradients of step t+1 (a copy of the optimizer's
// state; the values before it kept as the committed ones), and the next
// update first puts the committed values back.
#include <utility>

#include "hooks/grad_sync_impl.h"
#include "hooks/grad_sync_setup.h"

namespace ddpx {

void GradSync::Impl::on_stale_grad(int p) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(stale_mu);
  if (!stale_open) {
    stale_open = true;
    stale_t0 = now;
    stale_arrivals.clear();
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_stale(); });
  }
  stale_arrivals.emplace_back(p, now);
}

void GradSync::Impl::finish_stale() {
  const auto f0 = Clock::now();
  std::vector<std::pair<int, Clock::time_point>> arrivals;
  Clock::time_point start;
  {
    std::lock_guard<std::mutex> lock(stale_mu);
    arrivals = std::move(stale_arrivals);
    stale_arrivals.clear();
    start = stale_t0;
    stale_open = false;
  }
  hooks::Range range("ddpx::stale_callback");
  for (const auto& arrival : arrivals) {
    const int p = arrival.first;
    TORCH_CHECK(params[p].grad().layout() == at::kStrided, "GradSync: parameter '", names[p],
                "' got a ", params[p].grad().layout(), " gradient; GradSyncOptions::staleness(1) "
                "reduces dense gradients only (use staleness(0) for sparse ones)");
  }
  join();         // the last step (its failure is this backward's)
  apply_stale();  // its update; storage is the set this backward accumulated into
  if (opts.stale_lookahead_) stale_lookahead(arrivals);
  // Rank 0's buffers, as this forward left them, for the next forward (the
  // synchronous path sends them at this point too). The channels are idle:
  // the last step is done and this one has not launched.
  if (opts.broadcast_buffers_ && world > 1 && !buffers.empty()) {
    try {
      hooks::Range r("ddpx::broadcast_buffers");
      hooks::broadcast_from_rank0(channels[0]->pg(), buffers);
    } catch (...) {
      fail_step(std::current_exception());
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    begin_step_locked(&start);
    for (const auto& [p, when] : arrivals) {
      const at::Tensor& g = params[p].grad();
      if (!g.defined()) continue;
      grad_in_slot[p] = gather_grad(p, g) ? 1 : 0;
      mark_ready_locked(p, /*used=*/true);
      arrival_us[p] = hooks::us_since(t0, when);  // when backward produced it
      ++stats.hook_calls;
    }
  }
  stale_f0 = f0;
  finish_step();  // unused parameters, the launches, the agreement; on to the worker
  // The next backward accumulates into the other set (zeroed by the update
  // that freed it), not into the one on the wire.
  for (size_t p = 0; p < params.size(); ++p) {
    if (spare_views[p].defined()) params[p].mutable_grad() = spare_views[p];
  }
}

void GradSync::Impl::stale_lookahead(
    const std::vector<std::pair<int, Clock::time_point>>& arrivals) {
  hooks::Range range("ddpx::stale_lookahead");
  at::NoGradGuard no_grad;
  // The options of the step this backward ends (a schedule set them before
  // its forward): the step its exact update will take.
  optimizer->snapshot();
  std::vector<std::vector<int>> by_bucket(plan.size());
  std::vector<char> seen(params.size(), 0);
  for (const auto& arrival : arrivals) {
    const int p = arrival.first;
    if (seen[p] || !optimizer->steps(p) || !params[p].grad().defined()) continue;
    seen[p] = 1;
    by_bucket[bucket_of[p]].push_back(p);
  }
  if (committed.size() != params.size()) committed.resize(params.size());
  for (size_t b = 0; b < by_bucket.size(); ++b) {
    if (by_bucket[b].empty()) continue;
    for (int p : by_bucket[b]) {
      if (!committed[p].defined()) committed[p] = at::empty_like(params[p]);
      committed[p].copy_(params[p]);
      lookahead_params.push_back(p);
    }
    optimizer->lookahead(static_cast<int>(b), by_bucket[b]);
  }
}

void GradSync::Impl::restore_committed() {
  at::NoGradGuard no_grad;
  for (int p : lookahead_params) params[p].copy_(committed[p]);
  lookahead_params.clear();
}

void GradSync::Impl::apply_stale() {
  restore_committed();
  if (!stale_pending) return;
  stale_pending = false;
  hooks::Range range("ddpx::stale_update");
  for (size_t b = 0; b < plan.size(); ++b) {
    apply_bucket(static_cast<int>(b), stale_used.data(), /*stale=*/true);
  }
  std::swap(storage, spare_storage);
  std::swap(views, spare_views);
  if (deferred_replan) {
    auto r = std::move(*deferred_replan);
    deferred_replan.reset();
    replan(r.order, std::move(r.late), r.cuts, r.held);
  }
}

void GradSync::Impl::drain() {
  join();
  apply_stale();
}

void GradSync::Impl::stale_reset() {
  // The failed step's averages are gone, and so is what the next backward
  // accumulated on top of the set it ran on: both sets start from zero.
  at::NoGradGuard no_grad;
  restore_committed();  // the look-ahead's, of the failed step's gradients
  stale_pending = false;
  deferred_replan.reset();
  for (auto& t : storage) t.zero_();
  for (auto& t : spare_storage) t.zero_();
  for (size_t p = 0; p < params.size(); ++p) {
    if (views[p].defined()) params[p].mutable_grad() = views[p];
  }
}

}  // namespace ddpx
