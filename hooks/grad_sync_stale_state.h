#pragma once
// GradSync's state for one step stale (GradSyncOptions::staleness), a base
// of GradSync::Impl (grad_sync_impl.h), whose methods in grad_sync_stale.cpp
// use it. Data only: without staleness, all of it stays empty.
//
// Two sets of bucket tensors: storage/views hold the step in flight (its
// reductions run during the next step), spare_storage/spare_views the next
// one (.grad points there, so backward accumulates into it). A stale step's
// hooks only note arrivals; its final callback (finish_stale) waits for the
// last step, applies its update, swaps the sets and replays them.
#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace ddpx::hooks {

struct StaleState {
  using Clock = std::chrono::steady_clock;
  std::vector<at::Tensor> spare_storage, spare_views;
  std::atomic<int64_t> synced_steps{0};  // finish_step calls so far (the warm-up)
  bool step_stale = false;               // the step being completed is stale (finish_step sets it)
  std::mutex stale_mu;                   // a stale step's arrivals, noted by the hooks
  bool stale_open = false;
  Clock::time_point stale_t0;
  // A stale step's final callback began here (finish_step's end of
  // backward: what follows, the wait for the last step included, is exposed).
  std::optional<Clock::time_point> stale_f0;
  std::vector<std::pair<int, Clock::time_point>> stale_arrivals;
  bool stale_pending = false;   // the last step's update waits for apply_stale
  std::vector<int> stale_used;  // its agreed used flags
  struct Replan {
    std::vector<int> order;
    std::vector<char> late, cuts, held;
  };
  std::optional<Replan> deferred_replan;  // agreed by a stale step: after its update
  // GradSyncOptions::stale_lookahead: the parameters a lookahead moved
  // (forward runs on them) and their values without it, the committed
  // ones every rank shares (the exact update applies to these).
  std::vector<int> lookahead_params;
  std::vector<at::Tensor> committed;
};

}  // namespace ddpx::hooks
