#pragma once
// GradSync's state and its per-step protocol (private to hooks/). Its methods
// live one part per file: grad_sync_api.cpp (construction and the public
// methods), grad_sync_hook.cpp (the hooks), grad_sync_launch.cpp (launching
// buckets), grad_sync.cpp (the step's end: agreement, write-back), and
// grad_sync_plan/overlap/shard/stale.cpp; the sharded and the stale state are
// bases of their own (grad_sync_shard_state.h, grad_sync_stale_state.h).
#include <ddpx/grad_sync.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>

#include "hooks/bucket_optimizer.h"
#include "hooks/bucket_planner.h"
#include "hooks/channel.h"
#include "hooks/grad_sync_shard_state.h"
#include "hooks/grad_sync_stale_state.h"
#include "hooks/link_estimate.h"
#include "hooks/order_predictor.h"
#include "hooks/param_gate.h"
#include "hooks/priority_trial.h"
#include "hooks/profiler.h"
#include "hooks/reduce_fn.h"
#include "hooks/shard_map.h"
#include "hooks/stream_handoff.h"
#include "plugin/amp/master_weights.h"
#include "plugin/amp/scaler_access.h"
#include "plugin/comm/flight_recorder.h"
#include "plugin/comm/work_wait.h"
#include "plugin/torch_compat.h"

namespace ddpx {
namespace hooks {

using Clock = std::chrono::steady_clock;
inline double us_since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double, std::micro>(t - t0).count();
}

}  // namespace hooks

struct GradSync::Impl : hooks::ShardedState, hooks::StaleState {
  using Clock = hooks::Clock;
  // ---- fixed at construction ------------------------------------------------
  std::vector<std::string> names;
  std::vector<at::Tensor> params;   // requires_grad parameters only
  std::vector<at::Tensor> buffers;  // broadcast from rank 0 (broadcast_buffers)
  std::vector<hooks::ParamInfo> info;
  std::vector<GradAccumulatorPtr> accumulators;  // keep hooks alive
  std::vector<uintptr_t> hook_keys;  // per accumulator: our post hook, removed at destruction
  std::shared_ptr<std::atomic<Impl*>> alive;  // what the hooks call; null once destroyed
  GradSyncOptions opts;
  std::vector<std::unique_ptr<hooks::Channel>> channels;
  hooks::ReduceFn reduce;
  hooks::WireStatsFn wire_stats;
  std::shared_ptr<comm::Codec> lossy;  // the codec and its state (reduce_fn.h); null: "none"
  std::unique_ptr<hooks::Profiler> profiler;
  int world = 1;
  // The flight recorder (plugin/comm/flight_recorder.h): GradSync's group
  // there (-1: off), per bucket its parameters' names (set by replan), and
  // the calls recorded so far (the same sequence on every rank: buckets in
  // the plan's order, each step's agreement after its reliable buckets).
  int fr_group = -1;
  std::vector<int> fr_names;
  uint64_t fr_seq = 0;

  // ---- the plan (changes only at step boundaries) ---------------------------
  std::vector<hooks::BucketPlan> plan;
  std::vector<at::Tensor> storage;        // flat bucket tensors
  std::vector<int> bucket_of, offset_of;  // per parameter
  std::vector<at::Tensor> views;          // per parameter: its slot, shaped like it
  std::vector<std::string> keys;          // per bucket: the codec's state key
  std::vector<hooks::Shapes> shapes;      // per bucket: its parameters' shapes, slot order
  // Per bucket: its parameters' codec part keys (part_key; reduce_fn.h), slot
  // order: their warm starts follow the parameter across plans.
  std::vector<std::vector<std::string>> part_keys;
  static std::string part_key(int p) { return "param:" + std::to_string(p); }
  // part_key's inverse: the parameter, or -1 for another key.
  int param_of_part_key(const std::string& key) const {
    if (key.rfind("param:", 0) != 0) return -1;
    const int p = std::atoi(key.c_str() + 6);
    return p >= 0 && static_cast<size_t>(p) < params.size() && key == part_key(p) ? p : -1;
  }
  std::vector<char> plan_late;            // per parameter: late when the plan was made
  // Partial-run codec keys of late buckets (bucketB@off+len) -> (bucket,
  // offset), for carrying their residuals over a re-plan.
  std::map<std::string, std::pair<int, int64_t>> run_origin;
  // Per parameter: error-feedback residual (flat float32) owed from before
  // the last re-plan, added to its slot when the slot is next sent.
  std::vector<at::Tensor> carry;
  int carries = 0;  // defined entries of carry
  // Guards carry and carries during a step: a sharded bucket stepped during
  // backward (steps_early) may owe on the stepper thread while backward's
  // launches take carries.
  std::mutex carry_mu;
  hooks::OrderPredictor predictor;
  int64_t replans = 0;
  // The link as the reductions saw it (rate and per-reduction cost), for
  // comparing plans by when their reductions would finish.
  hooks::LinkEstimate link;
  int timing_gain_steps = 0;  // steps in a row a timing re-plan would have paid
  int priority_change_steps = 0;  // steps in a row the priority tail would have changed
  // Whether the held buckets go first layer first, measured (priority_trial.h);
  // this step's choice; rank 0's last end of backward (for the step's period).
  hooks::PriorityTrial priority_trial;
  bool priority_now = false;
  std::optional<Clock::time_point> last_end;
  // The held part of a plan is cut into this many buckets (priority_cuts):
  // the first layers' piece then lands after an eighth of the tail's bytes,
  // for seven more launches.
  static constexpr int kPriorityPieces = 8;
  // A bucket cut by priority (BucketPlan::held_from) holds back whole
  // pieces of this many elements (256 KiB of float32).
  static constexpr int64_t kPrioritySplitPiece = int64_t{1} << 16;
  // Per parameter: how often lately some rank used it (from the agreed
  // flags), so the planner counts what a late bucket really sends.
  hooks::UseRate used_anywhere;

  // ---- per-step state, under mu ---------------------------------------------
  std::mutex mu;
  bool active = false;
  std::atomic<bool> no_sync{false};
  // Per parameter: a gradient arrived under no_sync since the last synced
  // step. Such a parameter contributes its .grad even if the synced backward
  // does not touch it, so accumulation equals one large batch.
  std::unique_ptr<std::atomic<bool>[]> accumulated;
  std::vector<char> ready;
  // Per parameter: its hook found .grad to be the slot. Write-back then has
  // nothing to do for it and does not read .grad again (many520: write-back
  // 25 us -> 1 us a step).
  std::vector<char> grad_in_slot;
  // Per parameter: the sparse_dim of its last sparse (COO) gradient, e.g.
  // Embedding(sparse=true)'s; 0: dense. Buckets are dense: a sparse gradient
  // is added into its zeroed slot and written back as the sparse form of the
  // average, so optimizers that take sparse gradients still get one.
  std::vector<int8_t> sparse_dim;
  // Parameters planned sparse (info[p].sparse: a bucket of their own,
  // reduced by rows, sparse_reduce.h), learnt from the step-end agreement
  // once their gradients came sparse; the index dimensions of their rows.
  std::vector<int> sparse_params;
  std::vector<int8_t> planned_sparse_dim;
  // Per planned-sparse parameter: this step's gradient (.grad itself:
  // nothing is copied; undefined: none here) and the average for .grad.
  std::vector<at::Tensor> sparse_in, sparse_out;
  int64_t sparse_bytes = 0;  // sent by sparse buckets so far (the codec counts the rest)
  std::vector<int> pending;  // per bucket: gradients still missing
  int next_launch = 0;
  std::vector<int> launch_seq;  // buckets in the order they launched this step
  std::vector<int> arrival;
  std::vector<double> arrival_us;  // per parameter: us after t0; -1: none yet
  std::vector<int> idle_late;      // locally unused parameters of late buckets
  std::vector<int> carried;        // unused in this backward, accumulated under no_sync
  std::vector<int> surprises;      // Exact: gradients for parameters expected unused
  std::vector<std::future<void>> futures;
  // Per bucket: the reduction of a cut bucket's remainder (held_from), and
  // the cut bucket whose first part went out this step and whose remainder
  // waits for the held buckets (-1: none).
  std::vector<std::future<void>> rest_futures;
  int split_sent = -1;
  // Per bucket on a device with streams (stream_handoff.h): the streams that
  // wrote its slots this step, and the end of its reduction on its channel's
  // stream (set by the channel thread before its future is ready).
  std::vector<std::vector<c10::Stream>> wrote_on;
  std::vector<std::shared_ptr<hooks::StreamFence>> reduced;
  std::vector<char> expected_unused;  // Exact: from prepare_for_backward
  // Exact with late buckets: which parameters some rank will use this step,
  // agreed in prepare_for_backward, so late buckets need not wait for the
  // end of backward. Empty when not known.
  std::vector<char> early_used;
  // ---- layer dropping (declare_unused) ---------------------------------------
  // Per parameter: declared unused for the next synced backward. Set between
  // steps (under mu), read by the hooks without the lock, cleared at the
  // step's end.
  std::vector<char> declared;
  int n_declared = 0;
  std::vector<int> skipped_in;  // per bucket: its declared parameters this step
  // The ranks compare declarations on channel 0 ([hash, -hash, bad],
  // MAX-reduced), overlapping the forward; the step's first hook settles it.
  std::future<void> declare_check;
  at::Tensor declare_msg;
  // The comparison failed (a mismatch, a bad declaration, the collective):
  // nothing launches this step, and it ends in this error on every rank.
  std::exception_ptr declare_error;
  std::vector<int> declared_surprises;  // declared, yet a gradient came
  // ---- across the step boundary (GradSyncOptions::overlap) ------------------
  std::unique_ptr<hooks::BucketOptimizer> optimizer;  // set_optimizer: stepped per bucket
  // ---- sharded (GradSyncOptions::shard; state: grad_sync_shard_state.h) ------
  bool transient_storage() const { return opts.shard_ == Shard::Gradients; }
  void account(int64_t bytes);  // storage_bytes += bytes, and its peak
  // Gradients, before bucket b's storage is made: while the buckets would
  // pass bucket_limit, backward waits for the oldest reduction on the wire
  // (this rank launched it, so it completes without this rank's hooks).
  void make_room(int b);
  // Bucket b's storage and its slots, made (zeroed) if dropped; dropped
  // (the reduction that holds it frees it).
  void ensure_storage(int b);
  void drop_storage(int b);
  const hooks::ShardPart* my_part(int b) const;  // null: this rank owns none of b
  // Per parameter: the elements this rank steps (all of them unsharded).
  std::vector<std::pair<int64_t, int64_t>> owned_ranges() const;
  // The sharded path of a bucket: its reduction to the owners; the owned
  // elements of its used parameters stepped and the owners' parts of the
  // parameters written into the bucket, then gathered; the gathered
  // parameters copied out, the bucket zeroed (or released), gates opened.
  void launch_sharded_locked(int b, const std::vector<char>& anywhere);
  // (land_sharded: the owned averages become the parts' .grad; returns the
  // parameters to step, those some rank used; step_sharded steps them.
  // `on_channel`: the early step, already on the channel's stream behind
  // the reduction, so there is nothing to wait for.)
  std::vector<int> land_sharded(int b, const int* agreed, bool on_channel = false);
  void step_sharded(int b, const std::vector<int>& stepped);
  // Queues bucket b's gather (after its step) on its channel.
  void gather_sharded(int b);
  std::function<void(c10d::ProcessGroup&)> gather_body(int b);
  // Whether this step's reliable buckets are stepped and gathered as soon
  // as each is reduced, during backward, rather than after the step-end
  // agreement (EarlyStep). The same on every rank (the options, the agreed
  // declarations), as the collectives' order must be.
  bool steps_early() const;
  void queue_early_gather_locked();
  void finish_sharded(int b);
  // ---- mixed precision (GradSyncOptions::mixed_precision, ddpx/amp.h) -------
  // The float32 masters of low-precision parameters (inactive: none).
  amp::MasterWeights masters;
  // set_optimizer(optimizer, scaler): each landed average is unscaled into
  // `found` (per device), and the buckets are stepped only once all have
  // landed finite; scaler_inv is the step's 1 / scale, taken at the end of
  // backward (the scale is pending from then until complete_step updates it).
  detail::ScalerAccess::Handle scaler;
  at::Tensor scaler_inv;
  // The tensor parameter p's optimizer steps, whose .grad gets the average:
  // its master, or the parameter.
  const at::Tensor& stepped_tensor(int p) const {
    return masters.active() ? masters.master(p) : shard.active() ? shard_views[p] : params[p];
  }
  // NextForward: a gate per parameter, then per buffer (param_gate.h), and
  // the thread that completes each step after backward has returned (waits,
  // updates, the step's end); its failure is rethrown by join().
  std::shared_ptr<hooks::Gates> gates;
  std::unique_ptr<hooks::Channel> worker;
  std::future<void> completing;
  std::exception_ptr completion_error;
  // What the end of backward (finish_step) hands to complete_step.
  at::Tensor end_flags;
  std::future<void> end_agree;
  Clock::time_point end_f0;
  double end_cpu_us = 0;
  std::vector<char> used_here;  // per parameter: a gradient here this step (or no_sync's)
  // ---- one step stale (GradSyncOptions::staleness; state: grad_sync_stale_state.h)
  bool stale_now() const {
    return opts.staleness_ > 0 && synced_steps.load() >= opts.stale_warmup_;
  }
  void on_stale_grad(int p);
  // The final callback of a stale step.
  void finish_stale();
  // The pending update, the sets swapped, a deferred re-plan (between steps).
  void apply_stale();
  // join() and apply_stale(): nothing left in flight or pending.
  void drain();
  // The lookahead of this backward's arrivals (.grad: the rank's own
  // gradients, before the launches), and its undoing (the committed values
  // back, before an exact update or after a failure).
  void stale_lookahead(const std::vector<std::pair<int, Clock::time_point>>& arrivals);
  void restore_committed();
  // After a failed stale step: both sets zeroed, .grad on storage again.
  void stale_reset();
  StepStats stats, last;
  Clock::time_point t0;
  Clock::time_point agree_t0, agree_t1;  // the step-end agreement, on channel 0
  double last_trip_us = -1;              // its duration last step here; <0: none yet
  static constexpr int kNoTrip = std::numeric_limits<int>::min();
  std::atomic<double> hook_cpu_us{0};
  double begin_us = 0;  // of hook_cpu_us: the step's start, in its first hook

  Impl(GradSyncOptions o, int n)
      : opts(std::move(o)),
        carry(n),
        predictor(n),
        used_anywhere(n),
        accumulated(new std::atomic<bool>[n]()),
        sparse_dim(n, 0),
        planned_sparse_dim(n, 0),
        sparse_in(n),
        sparse_out(n),
        declared(n, 0) {}

  int64_t first_cap_bytes() const {
    return static_cast<int64_t>(opts.first_bucket_mb_ * (1 << 20));
  }
  int64_t cap_bytes() const { return static_cast<int64_t>(opts.bucket_cap_mb_ * (1 << 20)); }

  // late[p]: plan p into a late bucket (empty: none). Only Predict and Exact
  // have late buckets; under Off an unused parameter is an error anyway.
  // cuts: rank 0's timing cuts over `order` (plan_of; empty: sizes alone).
  // held: per parameter, its bucket is held for a priority launch
  // (priority_tail; empty: none).
  void replan(const std::vector<int>& order, std::vector<char> late,
              const std::vector<char>& cuts = {}, const std::vector<char>& held = {});

  // Zeroed bucket tensors for the plan, and each parameter's slot in them.
  std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> make_slots() const;

  std::vector<c10::Device> plan_devices() const {
    std::vector<c10::Device> out;
    for (const auto& b : plan) out.push_back(b.device);
    return out;
  }

  std::vector<std::vector<int>> bucket_params() const {
    std::vector<std::vector<int>> out;
    for (const auto& b : plan) out.push_back(b.params);
    return out;
  }

  // The codec's residuals under the current plan's keys become per-parameter
  // carries (a parameter seen under several run keys owes their sum: each
  // is a part of its inputs not sent yet). PowerSGD's warm starts stay with
  // the codec: they are kept per parameter (part_keys), whatever the plan.
  void carry_residuals();

  // Calls fn(p, r) for each slice r of the residuals `by_key` (keyed by the
  // current plan's bucket and run keys) that belongs to parameter p.
  void for_each_param_residual(const std::map<std::string, at::Tensor>& by_key,
                               const std::function<void(int, const at::Tensor&)>& fn) const;

  // Per parameter: the error feedback this rank owes it (the codec's residual
  // under the current keys plus any carry; flat float32, zeros where nothing
  // is owed; all undefined with codec "none"), leaving every state as it is.
  // What State::residuals holds.
  std::vector<at::Tensor> owed_residuals() const;

  // Adds `r` (p's numel elements) to what parameter p owes its next send.
  void owe(int p, const at::Tensor& r);

  // Is `g` (a parameter's .grad) the bucket slot itself? Then backward has
  // already accumulated into the bucket and there is nothing to copy. After a
  // re-plan, grads still viewing the old storage are not: they are copied.
  bool is_slot(int p, const at::Tensor& g) const;

  // Gradient `g` into p's slot. at::copy_ costs about a microsecond of
  // dispatch and TensorIterator set-up whatever the size: more than the bytes
  // of a small gradient (4 KB: ~0.1 us), and under zero_grad(set_to_none),
  // LibTorch's default, every hook pays it. So a small dense CPU gradient laid
  // out like its slot is moved by memcpy. Anything else (another dtype,
  // device or layout, a conj/neg view, a size copy_ would split over intra-op
  // threads, memory that overlaps the slot) goes through copy_.
  void copy_to_slot(int p, const at::Tensor& g);

  // Brings p's gradient `g` (defined) into its slot and records whether it
  // is sparse; returns whether `g` already was the slot (nothing copied).
  bool gather_grad(int p, const at::Tensor& g);

  // First hook of a backward: reset the step and queue the final callback.
  // A stale step's replay (finish_stale) gives its first hook's time and
  // runs the final callback itself.
  void begin_step_locked(const Clock::time_point* replay_start = nullptr);

  // Bucket b's slots are being written on this thread's current stream.
  void note_writer_locked(int b);

  void mark_ready_locked(int p, bool used);
  // Launches, in plan order, every bucket that is complete (and whose turn
  // it is); late ones only once the used parameters are agreed.
  void launch_ready_locked();

  // First hook: waits for the comparison of declarations (declare_unused)
  // and, if the ranks agree, takes the declared parameters out of the step.
  void settle_declared_locked();
  void clear_declared_locked();

  // Launches bucket b; a late one without the slots that no rank used
  // (`anywhere`: the agreed used flags), any without the slots declared
  // unused, or not at all if nothing is left.
  void launch_bucket_locked(int b, const std::vector<char>& anywhere);

  // A contiguous range of a bucket's storage: [offset, offset + numel).
  struct Run {
    int64_t offset, numel;
  };

  // Launches bucket b's reduction on its channel: the whole bucket, or (a
  // late bucket) only the runs of slots of parameters used on some rank
  // (`runs` empty: the whole bucket).
  // `into`: where the reduction's future goes (null: futures[b]).
  void launch_locked(int b, std::vector<Run> runs = {}, std::future<void>* into = nullptr);
  // The held remainder of the bucket cut by priority (split_sent), if any.
  void launch_rest_locked();
  // Sparse bucket b's reduction: its parameter's rows (sparse_reduce.h).
  void launch_sparse_locked(int b);
  // Queues `body` (bucket b's reduction) on b's channel; on a device, on the
  // channel's stream after the streams that wrote b, with `keep` (storages
  // made on other streams that body uses) marked in use there.
  // `op`: the flight recorder's name for it; its end is the bucket's
  // complete_us, but a sharded bucket's gather's (kAllGather; gather_body
  // times it). `tail`: kOverlaps for a body that is one allreduce_sum (the
  // next one may start once it is on the wire; channel.h).
  void submit_locked(int b, std::function<void(c10d::ProcessGroup&)> body,
                     std::vector<c10::Storage> keep, std::future<void>* into = nullptr,
                     comm::detail::FrOp op = comm::detail::FrOp::kAllReduce,
                     hooks::Channel::Tail tail = hooks::Channel::Tail::kSerial);

  // (slot, residual) of the parameters in bucket b's `runs` that owe a
  // residual from before a re-plan; they owe nothing afterwards.
  std::vector<std::pair<at::Tensor, at::Tensor>> take_carries_locked(int b,
                                                                     const std::vector<Run>& runs);

  // The runs of bucket b's slots to send: not declared unused and, in a late
  // bucket, used by some rank (globally_used from the step-end agreement);
  // empty when none is.
  std::vector<Run> sent_runs(int b, const std::vector<char>& globally_used,
                             bool sent = true) const;
  // The complement: the slots of the parameters no rank uses this step.
  std::vector<Run> unsent_runs(int b, const std::vector<char>& globally_used) const {
    return sent_runs(b, globally_used, false);
  }
  bool idle_in_step(int b, int p, const std::vector<char>& globally_used) const;
  // (Sharded, grad_sync_shard.cpp: a codec's reduce-scatter of bucket b,
  // the `idle` slots' residuals put back; this rank's part of the mean, or
  // undefined.)
  at::Tensor scatter_through_codec(int b, const at::Tensor& flat,
                                   const std::vector<hooks::ShardPart>& parts,
                                   const std::vector<Run>& idle, c10d::ProcessGroup& pg);

  void on_grad(int p);

  // What the planner knows of time, from predictor `p` (after two timed
  // steps; else null): the predicted arrivals, the link as measured, and the
  // idle time worth a launch: 2% of backward, at least 1 ms and twice the
  // measured cost of a launch (a shorter one cannot buy it back).
  std::optional<hooks::PlanTiming> timing_of(const hooks::OrderPredictor& p) const;

  // Under Exact the ranks agree on use in prepare_for_backward, so a late
  // bucket launches when it is ready and belongs where its gradients arrive;
  // under Predict the agreement comes at the end of backward, and so do they.
  // (Sharded buckets go whole, in plan order: no priority.)
  bool prioritised() const {
    return opts.overlap_ == Overlap::NextForward && opts.priority_ && !shard.active();
  }

  // The buckets `p` holds for priority under `timing`: priority_tail's
  // run, down to a single bucket when that one overtakes a bucket cut by
  // priority_split (codec none). The plan's own rule, so that a re-plan
  // proposes itself only when it changes.
  std::vector<char> held_tail(const std::vector<hooks::BucketPlan>& p,
                              const hooks::PlanTiming& timing) const;

  // Final callback: launches the held buckets (all complete by now) in
  // reverse plan order, the first layers' first.
  void launch_held_locked();

  bool late_at_end() const { return opts.unused_ != Unused::Exact; }
  std::vector<int> order_of(const hooks::OrderPredictor& p) const {
    return p.predicted_order(late_at_end());
  }

  // The plan for `order` under `timing` (timing_of; none: sizes alone);
  // `timing_cuts` gets the cuts its timing made.
  std::vector<hooks::BucketPlan> plan_of(const std::optional<hooks::PlanTiming>& timing,
                                         const std::vector<int>& order,
                                         const std::vector<char>& late,
                                         std::vector<char>* timing_cuts = nullptr) const {
    if (!timing) return hooks::plan_buckets(order, info, first_cap_bytes(), cap_bytes(), late);
    return hooks::plan_buckets_cheapest(order, info, first_cap_bytes(), cap_bytes(), late, *timing,
                                        timing_cuts);
  }

  hooks::OrderPredictor with_this_step() const {
    hooks::OrderPredictor next = predictor;
    next.observe(arrival, nullptr, &arrival_us, &declared);
    return next;
  }

  // Would a plan from the updated prediction launch buckets materially
  // earlier under this step's arrival order than the current plan does, or
  // (timing) finish its reductions materially earlier under the predicted
  // arrival times and the measured link? (Rank 0's view decides; a change of
  // the late set is decided apart, from agreed data, in finish_step.)
  bool should_replan();

  // After a step's reductions: a small collective's round trip (`trip_us`,
  // the per-reduction cost; <0: none), then each bucket's bytes and the time
  // the link was busy with it (one queued behind another starts when that
  // one completes), for the link's rate.
  void learn_link_rate(double trip_us);

  // MAX-allreduces int flags in place on channel 0 (after what is queued
  // there), in a torch.profiler range named `range`; t0/t1 (if given) get
  // its start and end; `record_step`: in the flight recorder, as the step's.
  std::future<void> agree_max(at::Tensor flags, const char* range, Clock::time_point* t0 = nullptr,
                              Clock::time_point* t1 = nullptr, bool record_step = false);
  // The flight recorder's record of bucket b's collective `op` (its bytes,
  // the step, the bucket and its parameters), and `body` in the record of
  // `call` (group and sequence number set here), stamped as a channel runs
  // it (recorder off: body).
  comm::detail::FlightRecorder::Call fr_call(int b, comm::detail::FrOp op) const;
  std::function<void(c10d::ProcessGroup&)> recorded_locked(
      comm::detail::FlightRecorder::Call call, std::function<void(c10d::ProcessGroup&)> body);

  std::vector<char> late_for(const hooks::OrderPredictor& p) const {
    return opts.unused_ == Unused::Off ? std::vector<char>(params.size(), 0) : p.late_set();
  }

  // The end of backward (the final callback): unused parameters, the last
  // launches, the step-end agreement queued; then complete_step, here or
  // (NextForward) on the worker once the gates are closed.
  void finish_step();
  // The rest of the step: late buckets, the waits (and, with an optimizer,
  // each bucket's update as it lands), write-back, learning, re-planning,
  // rank 0's buffers, the step's record.
  void complete_step();
  // This thread's current streams wait for every bucket's reduction (a
  // sparse average marked in use on them).
  void block_on_reductions();
  // NextForward: waits for the worker's step; rethrows its failure once.
  void join();
  // Does bucket b's update wait for the step-end agreement (a parameter not
  // used here may be used elsewhere; Exact and declare_unused may yet fail
  // the step)?
  bool needs_agreement(int b) const;
  // Bucket b's averages to .grad and its parameters stepped (`agreed`: the
  // agreed used flags; null: all of b was used here), .grad consumed, the
  // gates opened.
  // `stale`: the update of the step before (apply_stale): .grad holds the
  // next step's gradient, so the average stands in for it during the update.
  void apply_bucket(int b, const int* agreed, bool stale = false) {
    step_bucket(b, land_bucket(b, agreed, stale), stale, /*skip=*/false);
  }
  // apply_bucket's halves, apart under a GradScaler (every bucket must land
  // before any is stepped): the averages written back (to the masters'
  // .grad under mixed precision), returning the parameters to step; then
  // those stepped (or, `skip`, not), the masters rounded into the
  // parameters, the gradients consumed and the gates opened.
  std::vector<int> land_bucket(int b, const int* agreed, bool stale);
  void step_bucket(int b, const std::vector<int>& stepped, bool stale, bool skip);
  // Under a GradScaler, once every bucket (in `seq`, their landing order)
  // has landed (`landed`: each one's parameters to step) and been unscaled
  // into `found`: all stepped, or none if some average was inf or NaN
  // (stats.skipped); then the scaler's update.
  void scaled_step(const std::vector<int>& seq, const std::vector<std::vector<int>>& landed,
                   const amp::FoundInf& found);
  // GradSyncOptions::clip_grad_norm, once every bucket has landed (`landed`:
  // per bucket, the parameters to step): their averages scaled so that the
  // global norm is at most the limit (sharded: over every rank's parts).
  void clip_landed(const std::vector<std::vector<int>>& landed);
  // The step-end agreement flagged a surprise gradient: the error.
  std::exception_ptr surprise_error();
  [[noreturn]] void fail_step(std::exception_ptr error);
  void flush_trace() {
    channels[0]->submit([this](c10d::ProcessGroup& pg) { profiler->flush(&pg); }).get();
  }
  void write_back(const std::vector<char>& globally_used);
  void write_back_param(int p, bool globally_used);
  // At construction: the parameters `declared` sparse on any rank (a MAX
  // over pg, so every rank plans alike) get sparse buckets from the start,
  // with rows along their first dimension (an embedding's).
  void declare_sparse(c10d::ProcessGroup& pg, const std::vector<std::string>& declared);
  // From the step-end agreement's used flags (1 + sparse_dim): parameters
  // whose gradients came sparse get (or lose) a sparse bucket; true if the
  // set changed (a re-plan is due).
  bool learn_sparse(const int* used_flags);
  void replan_agreed(c10d::ProcessGroup& pg);
};

}  // namespace ddpx
