// GradSync's bucket plan: building one (replan, its slots), what the
// planner knows of time, whether to re-plan, and the plan every rank adopts
// from rank 0 (replan_agreed), which gradients come sparse (their buckets of
// their own). The planner itself is hooks/bucket_planner.
#include <algorithm>

#include "hooks/grad_sync_impl.h"

namespace ddpx {

void GradSync::Impl::replan(const std::vector<int>& order, std::vector<char> late,
                            const std::vector<char>& cuts, const std::vector<char>& held) {
  if (opts.unused_ == Unused::Off) late.clear();
  // Keys name buckets by index: after a re-plan a key holds other slots, so
  // the codec's state starts over; its residuals move to the parameters.
  carry_residuals();
  plan = hooks::plan_buckets(order, info, first_cap_bytes(), cap_bytes(), late, cuts);
  if (!held.empty()) {
    for (auto& b : plan) b.held = !b.params.empty() && held[b.params.front()] != 0;
  }
  plan_late = late.empty() ? std::vector<char>(params.size(), 0) : std::move(late);
  keys.clear();
  shapes.assign(plan.size(), {});
  part_keys.assign(plan.size(), {});
  bucket_of.assign(params.size(), -1);
  offset_of.assign(params.size(), 0);
  for (size_t b = 0; b < plan.size(); ++b) {
    keys.push_back("bucket" + std::to_string(b));
    int64_t off = 0;
    // Sharded: slots in ascending parameter order, so that each owner's
    // elements are one contiguous part of the bucket (shard_map.h).
    std::vector<int> layout = plan[b].params;
    if (shard.active()) std::sort(layout.begin(), layout.end());
    for (int p : layout) {
      bucket_of[p] = static_cast<int>(b);
      if (plan[b].sparse) continue;  // no slot: its rows travel apart
      offset_of[p] = static_cast<int>(off);
      shapes[b].push_back(params[p].sizes().vec());
      part_keys[b].push_back(part_key(p));
      off += info[p].numel;
    }
  }
  if (fr_group >= 0) {
    fr_names.clear();
    for (const auto& bucket : plan) {
      std::vector<std::string> list;
      for (int p : bucket.params) list.push_back(names[p]);
      fr_names.push_back(comm::detail::FlightRecorder::get().names(std::move(list)));
    }
  }
  shard_parts.clear();
  if (shard.active()) {
    for (const auto& bucket : plan) shard_parts.push_back(shard.parts(bucket.params, offset_of));
  }
  // The old buckets go now; this thread's queued work may still read them
  // (the write-back, the optimizer), and they were made on the stream the
  // constructor or the last re-plan ran on.
  hooks::mark_in_use_here(storage);
  hooks::mark_in_use_here(spare_storage);
  if (transient_storage()) {
    // Made as each bucket is first used in a step (ensure_storage); the
    // old plan's are released by now (finish_sharded).
    storage.assign(plan.size(), at::Tensor());
    views.assign(params.size(), at::Tensor());
    storage_bytes = 0;
    int64_t largest = 0;
    for (const auto& b : plan) {
      largest = std::max(largest, b.numel * static_cast<int64_t>(c10::elementSize(b.dtype)));
    }
    bucket_limit = 2 * largest;
    bucket_bytes = 0;
  } else {
    std::tie(storage, views) = make_slots();
    int64_t bytes = 0;
    for (const auto& t : storage) bytes += static_cast<int64_t>(t.nbytes());
    storage_bytes = bytes;
  }
  if (opts.staleness_ > 0) {
    std::tie(spare_storage, spare_views) = make_slots();
  }
  if (optimizer) optimizer->plan(bucket_params());
}

std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> GradSync::Impl::make_slots() const {
  std::vector<at::Tensor> flat, slot(params.size());
  for (size_t b = 0; b < plan.size(); ++b) {
    flat.push_back(at::zeros({plan[b].numel},
                             at::TensorOptions().dtype(plan[b].dtype).device(plan[b].device)));
    if (plan[b].sparse) continue;
    for (int p : plan[b].params) {
      // detach(): an alias, not an autograd view; LibTorch's
      // Optimizer::zero_grad calls detach_() on .grad, which views reject.
      slot[p] = flat[b].narrow(0, offset_of[p], info[p].numel).view(params[p].sizes()).detach();
    }
  }
  return {std::move(flat), std::move(slot)};
}

std::optional<hooks::PlanTiming> GradSync::Impl::timing_of(const hooks::OrderPredictor& p) const {
  const auto& t = p.predicted_arrival_us();
  if (!opts.timed_plans_ || t.empty() || p.timed_steps() < 2) return std::nullopt;
  const double backward = *std::max_element(t.begin(), t.end());
  // A bucket stepped during backward is three collectives: its ranks' used
  // flags (under Unused::Predict), its reduction and its gather.
  double per_bucket = 1;
  if (shard.active() && steps_early()) per_bucket = opts.unused_ == Unused::Predict ? 3 : 2;
  const double launch = per_bucket * link.launch_us();
  const double gap = std::max({1000.0, 0.02 * backward, 2 * launch});
  std::vector<double> late_bytes(params.size());
  for (size_t q = 0; q < params.size(); ++q) {
    late_bytes[q] = static_cast<double>(info[q].numel) *
                    static_cast<double>(c10::elementSize(info[q].dtype)) *
                    used_anywhere[static_cast<int>(q)];
  }
  const double rate = link.bytes_per_us();
  return hooks::PlanTiming{t, gap, rate, launch, late_at_end(), std::move(late_bytes)};
}

bool GradSync::Impl::should_replan() {
  // Only rank 0's proposal counts (finish_step), and the timing plans it
  // compares cost ~50 us a step at 520 tensors: the other ranks skip it.
  if (!opts.replan_ || channels[0]->pg().getRank() != 0) return false;
  const hooks::OrderPredictor next = with_this_step();
  if (next.stable_steps() < 1) return false;  // this order must have repeated
  const int n = static_cast<int>(params.size());
  // late_for(predictor): the agreed late set so far
  const auto timing = timing_of(next);
  const auto candidate = plan_of(timing, order_of(next), late_for(predictor));
  if (hooks::reorder_pays(plan, candidate, arrival, n)) return true;
  // The priority tail of the current plan moved (held on two steps in a
  // row, against churn).
  if (prioritised() && timing) {
    const auto tail = held_tail(plan, *timing);
    bool same = true;
    for (size_t b = 0; b < plan.size(); ++b) same = same && (tail[b] != 0) == plan[b].held;
    priority_change_steps = same ? 0 : priority_change_steps + 1;
    if (priority_change_steps >= 2) return true;
  }
  if (!timing || timing->bytes_per_us <= 0) return false;
  const double now = hooks::predicted_cost_us(plan, *timing);
  const double then = hooks::predicted_cost_us(candidate, *timing);
  // Hysteresis, against churn: step-to-step noise in the arrival times and
  // the rate moves the model's finish by a few percent (seen: up to 4.5%
  // on many520, with the cuts shifting by a few parameters), so a timing
  // re-plan must gain over 5% (at least 1 ms) on two steps in a row.
  timing_gain_steps = then < now - std::max(1000.0, 0.05 * now) ? timing_gain_steps + 1 : 0;
  return timing_gain_steps >= 2;
}

void GradSync::Impl::learn_link_rate(double trip_us) {
  if (trip_us >= 0) link.add_round_trip(trip_us);
  // A sharded bucket's gather counts with its reduction (link_busy_us):
  // counting the reductions alone made the link look twice as fast, and
  // the timing plans then cut the transformer's backward into fewer
  // buckets, one of 3 MB gathered after 60% of backward, the link idle
  // meanwhile (ZeRO-1 and ZeRO-2 1.08x unsharded's step at 2 ranks, 10
  // rounds of scripts/bench/zero; 1.03x since).
  std::vector<hooks::LinkSpan> spans;
  for (size_t i = 0; i < stats.buckets.size(); ++i) {
    const auto& b = stats.buckets[i];
    // (A sparse bucket's collectives are gathers of rows, not the link's
    // all-reduce rate.)
    // (Nor a cut bucket's: the held buckets ran between its parts.)
    if (b.bytes == 0 || plan[b.index].sparse || b.held_bytes > 0) continue;
    spans.push_back({b.launch_us, b.complete_us, i});
    if (b.gathered_us >= 0) spans.push_back({b.gather_us, b.gathered_us, i});
  }
  const auto busy = hooks::link_busy_us(std::move(spans), stats.buckets.size());
  std::vector<std::pair<double, double>> samples;
  for (size_t i = 0; i < busy.size(); ++i) {
    if (busy[i] >= 0) samples.emplace_back(static_cast<double>(stats.buckets[i].bytes), busy[i]);
  }
  link.add_step(samples);
}

std::vector<char> GradSync::Impl::held_tail(const std::vector<hooks::BucketPlan>& p,
                                            const hooks::PlanTiming& timing) const {
  auto tail = hooks::priority_tail(p, timing, 1);
  if (std::count(tail.begin(), tail.end(), 1) == 1 &&
      (opts.codec_ != "none" ||
       hooks::priority_split(p, tail, timing, kPrioritySplitPiece).bucket < 0)) {
    std::fill(tail.begin(), tail.end(), 0);
  }
  return tail;
}

void GradSync::Impl::replan_agreed(c10d::ProcessGroup& pg) {
  // Every rank adopts rank 0's predicted order, late set and timing cuts
  // (its arrival times are its own): [order | late | cuts].
  const int64_t n = static_cast<int64_t>(params.size());
  // [order | late | cuts | held (per parameter: its bucket held, priority) |
  //  the bucket cut by priority, or -1 | where its held remainder starts]
  auto msg = at::zeros({4 * n + 2}, at::kLong);
  int64_t* o = msg.data_ptr<int64_t>();
  if (pg.getRank() == 0) {
    const auto order = order_of(predictor);
    const auto late = late_for(predictor);
    std::vector<char> cuts;
    const auto timing = timing_of(predictor);
    auto next = plan_of(timing, order, late, &cuts);
    if (cuts.empty()) cuts.assign(n, 0);
    std::vector<char> tail;
    if (prioritised() && timing) {
      // (Even one bucket: cut into pieces, the first layers' go first.)
      tail = hooks::priority_tail(next, *timing, 1);
      if (std::find(tail.begin(), tail.end(), 1) != tail.end()) {
        // The held part in pieces, so the first layers' bucket is small.
        const auto pieces = hooks::priority_cuts(next, tail, order, info, kPriorityPieces);
        for (int64_t i = 0; i < n; ++i) cuts[i] = cuts[i] || pieces[i];
        next = hooks::plan_buckets(order, info, first_cap_bytes(), cap_bytes(), late, cuts);
        tail = held_tail(next, *timing);
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      o[i] = order[i];
      o[n + i] = late[i];
      o[2 * n + i] = cuts[i];
    }
    for (size_t b = 0; b < tail.size(); ++b) {
      for (int p : next[b].params) o[3 * n + p] = tail[b];
    }
    // (A lossy codec keeps state per run: its buckets stay whole.)
    const auto split = opts.codec_ == "none" && !tail.empty()
                           ? hooks::priority_split(next, tail, *timing, kPrioritySplitPiece)
                           : hooks::PrioritySplit{};
    o[4 * n] = split.bucket;
    o[4 * n + 1] = split.from;
  }
  std::vector<at::Tensor> t{msg};
  comm::detail::wait_named(pg.broadcast(t));
  std::vector<int> order(o, o + n);
  std::vector<char> late(o + n, o + 2 * n);
  std::vector<char> cuts(o + 2 * n, o + 3 * n);
  std::vector<char> held(o + 3 * n, o + 4 * n);
  if (step_stale) {
    // The step's averages still sit in the current slots, to be applied at
    // the end of the next backward: the new plan waits for that.
    deferred_replan = Replan{std::move(order), std::move(late), std::move(cuts), std::move(held)};
  } else {
    replan(order, std::move(late), cuts, held);
    // (Rank 0 planned the same buckets from the same order and cuts.)
    const int64_t split = o[4 * n], from = o[4 * n + 1];
    if (split >= 0 && split < static_cast<int64_t>(plan.size()) && from > 0 &&
        from < plan[split].numel) {
      plan[split].held_from = from;
    }
  }
  priority_change_steps = 0;
  timing_gain_steps = 0;
  ++replans;
}

void GradSync::Impl::declare_sparse(c10d::ProcessGroup& pg,
                                    const std::vector<std::string>& declared) {
  auto flags = at::zeros({static_cast<int64_t>(params.size())}, at::kInt);
  int* f = flags.data_ptr<int>();
  for (const auto& name : declared) {
    const auto it = std::find(names.begin(), names.end(), name);
    TORCH_CHECK(it != names.end(), "GradSync: sparse_params names '", name,
                "', which is not a parameter that requires grad");
    f[it - names.begin()] = 1 + 1;  // used, with rows along dimension 0
  }
  std::vector<at::Tensor> t{flags};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  comm::detail::wait_named(pg.allreduce(t, o));
  learn_sparse(f);
}

bool GradSync::Impl::learn_sparse(const int* used_flags) {
  // A parameter some rank used this step: sparse if some rank's gradient
  // was (used_flags[p] = 1 + sparse_dim, MAX over ranks), so every rank
  // learns alike. Unused ones keep what they had.
  // (Under mixed_precision a sparse gradient stays in its dense slot: the
  // rows would be reduced in the gradient's own dtype, not reduce_dtype.)
  if (opts.reduce_dtype_) return false;
  bool changed = false;
  for (size_t p = 0; p < params.size(); ++p) {
    if (used_flags[p] == 0) continue;
    const int sd = used_flags[p] - 1;
    if ((sd > 0) == info[p].sparse && (sd == 0 || sd == planned_sparse_dim[p])) continue;
    info[p].sparse = sd > 0;
    planned_sparse_dim[p] = static_cast<int8_t>(sd);
    changed = true;
  }
  if (changed) {
    sparse_params.clear();
    for (size_t p = 0; p < params.size(); ++p) {
      if (info[p].sparse) sparse_params.push_back(static_cast<int>(p));
    }
  }
  return changed;
}

}  // namespace ddpx
