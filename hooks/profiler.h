#pragma once
// The hook profiler: what GradSync's own machinery costs, step by step.
//
// Two outputs, both cheap when unused:
//  - a per-step record (always on: a few numbers per step, never per
//    parameter) behind GradSync::profile() / profile_summary();
//  - a Chrome/Perfetto trace (DDPX_TRACE=path or GradSyncOptions::trace) of
//    a window of steps (DDPX_TRACE_STEPS=a:b, inclusive, 1-based; default
//    1:20). Outside the window the hooks pay one branch.
// Independently, every phase opens an at::RecordFunction range
// ("ddpx::hook", "ddpx::bucket_launch", "ddpx::allreduce[bucket3]", sharded
// "ddpx::gather[bucket3]", "ddpx::codec_wire", "ddpx::final_wait",
// "ddpx::<phase>"), so torch.profiler
// and the autograd profiler show them; the channel threads inherit the
// launching thread's profiler state for the bucket they run.
//
// Trace protocol (collective: every rank, same order):
//  1. Construction (Profiler::agree): one MAX-allreduce of (enabled, window,
//     rank 0's "cannot open the file") and their negations, so tracing is on
//     everywhere or nowhere, with the same window, and an unwritable path is
//     an error on every rank before training starts. Rank 0 keeps the file
//     open. Timestamps are microseconds since the end of that allreduce, the
//     closest thing to a common clock the ranks have.
//  2. Steps in the window record events locally (no communication).
//  3. Flush (the first step after the window, GradSync::flush_trace(), or the
//     destructor): each rank serialises its events; an allgather of sizes and
//     one of the padded payloads brings them to rank 0, which writes one
//     {"traceEvents": [...]} file, one pid per rank. Later flushes are no-ops.
//     The destructor skips the gather (rank 0 writes its own events only) when
//     a step failed or an exception is unwinding: a peer may be gone.
//
// Tracks (tid) per rank: 0 "step" (backward, final callback, final wait,
// write-back, trainer phases such as optimizer_step), 100+ "hooks" (one
// event per bucket: first to last hook of the bucket, with the summed hook
// CPU time and call count; overlapping buckets get another lane), 1000+c
// "channel c" (per bucket: ready and launch instants, the reduction from the
// start of its run to completion, with encode / wire / decode inside; runs
// in flight together (calls_in_flight) on lanes 1100+c, 1200+c, ...; on
// channel 0 also the step-end agreement, "ddpx::step_agreement").
#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <ddpx/codec.h>
#include <ddpx/grad_sync.h>

#include <chrono>
#include <cstdint>
#include <atomic>
#include <deque>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "plugin/comm/wire_span.h"

namespace ddpx::hooks {

using Clock = std::chrono::steady_clock;

// Where tracing goes: options first, then the environment.
struct TraceConfig {
  std::string path;  // "" = off
  int64_t first_step = 1, last_step = 20;
  static TraceConfig from(const GradSyncOptions& o);  // throws on a bad window
};

// One bucket of one traced step. Written by the hooks (under GradSync's
// lock) and by the bucket's channel thread (its own slot only); read at the
// step's end, after every reduction has been awaited.
struct BucketTrace {
  int64_t hook_first_ns = -1, hook_last_ns = -1, hook_cpu_ns = 0, hooks = 0;
  int64_t run_begin_ns = -1, run_end_ns = -1;
  comm::detail::WireSpan wire;
  // Sharded (GradSyncOptions::shard): the bucket's gather, after its step.
  int64_t gather_begin_ns = -1, gather_end_ns = -1;
  comm::detail::WireSpan gather_wire;
};

// The times of a step's final callback (GradSync::Impl::finish_step).
struct FinalTimes {
  Clock::time_point t0, begin, wait_begin, wait_end, end;
  Clock::time_point agree_begin, agree_end;  // used-bitmap / re-plan agreement, channel 0
};

// One step of the always-on record (summary input).
struct StepRecord {
  int64_t step = 0;
  double backward_us = 0, comm_us = 0, exposed_us = 0, hook_cpu_us = 0, hooks_only_us = 0;
  double gate_wait_us = 0;  // NextForward: the forward's waits at gates (in exposed_us too)
  double memory_wait_us = 0;  // Shard::Gradients: backward's waits for bucket memory
  int64_t held_buckets = 0, overtaken_bytes = 0;  // priority (ProfileSummary)
  int64_t hook_calls = 0, bytes_sent = 0, bytes_raw = 0, replans = 0, mispredictions = 0;
};

// A "ddpx::..." range for torch.profiler (USER_SCOPE, like Python's
// record_function); costs RecordFunction's callback check when nobody listens.
class Range {
 public:
  explicit Range(const char* name) : rf_(at::RecordScope::USER_SCOPE) {
    if (rf_.isActive()) rf_.before(name);
  }
  void end() { rf_.end(); }  // before scope exit
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  at::RecordFunction rf_;
};

// What a bucket launch hands its channel thread.
struct LaunchContext {
  int bucket = 0;
  bool gather = false;                        // a sharded bucket's gather, not its reduction
  BucketTrace* slot = nullptr;                // null: step not traced
  std::shared_ptr<at::ThreadLocalState> tls;  // set while a profiler listens
};

// Around one bucket's reduction (or gather) on its channel thread.
class ReduceScope {
 public:
  explicit ReduceScope(const LaunchContext& ctx);
  ~ReduceScope();
  ReduceScope(const ReduceScope&) = delete;
  ReduceScope& operator=(const ReduceScope&) = delete;

 private:
  // Declared (so built and torn down) in this order: the launching thread's
  // profiler state must be in place before the range looks for listeners.
  std::optional<at::ThreadLocalStateGuard> tls_;
  std::optional<at::RecordFunction> rf_;
  int64_t* end_ns_ = nullptr;  // the slot's run or gather end; null: not traced
  comm::detail::WireSpan* prev_ = nullptr;
};

class Profiler {
 public:
  Profiler(TraceConfig cfg, int rank, int world, int64_t params);
  ~Profiler();

  // Step 1 of the protocol; collective. Throws on an unwritable path.
  void agree(c10d::ProcessGroup& pg);

  // ---- recording (called by GradSync) ---------------------------------------
  void begin_step(int64_t step, Clock::time_point t0, int buckets);
  bool tracing() const { return tracing_; }
  // One hook of a parameter of `bucket`, [h0, h1]; call only when tracing().
  void on_hook(int bucket, Clock::time_point h0, Clock::time_point h1);
  LaunchContext launch_context(int bucket, bool gather = false);
  void end_step(const StepStats& s, const FinalTimes& t, double hooks_only_us,
                const comm::CodecStats& wire_total);
  // A trainer phase (GradSync::phase), attributed to the last finished step.
  void phase(const std::string& name, Clock::time_point begin, Clock::time_point end);

  // ---- output ---------------------------------------------------------------
  bool flush_due() const;  // the window is over and nothing was written yet
  bool needs_flush() const { return enabled_ && !flushed_; }
  // Step 3 of the protocol; collective unless gather is false.
  void flush(c10d::ProcessGroup* pg);
  bool step_failed() const { return step_open_; }

  ProfileSummary summary() const;

 private:
  // One trace event; times are steady-clock nanoseconds, args plain numbers.
  struct Event {
    std::string name;
    char ph;  // 'X' complete, 'i' instant
    int tid;
    int64_t ts_ns, dur_ns;
    std::vector<std::pair<std::string, double>> args;
  };
  double ts(int64_t ns) const;
  double ts(Clock::time_point t) const;
  void record_step_events(const StepStats& s, const FinalTimes& t, const StepRecord& r);
  std::string local_events_json() const;

  TraceConfig cfg_;
  int rank_, world_;
  int64_t params_;
  bool enabled_;
  bool tracing_ = false, step_open_ = false;
  // Read by phase() on the trainer's thread while NextForward's worker ends
  // a step (end_step) or writes the trace (flush).
  std::atomic<bool> flushed_{false};
  int64_t step_ = 0;
  std::atomic<int64_t> last_finished_{0};
  Clock::time_point anchor_;
  std::ofstream file_;  // rank 0, open from agree() to flush
  std::vector<BucketTrace> buckets_;
  mutable std::mutex mu_;  // events_, records_
  std::vector<Event> events_;
  std::deque<StepRecord> records_;
  comm::CodecStats wire_before_;
  int64_t replans_before_ = 0;
};

// Wall time with at least one bucket on the wire (the union of launch ->
// complete and of a sharded bucket's gather): the communication the step has
// to hide. StepStats::comm_us sums the buckets instead, counting concurrent
// reductions twice.
double comm_wall_us(const std::vector<StepStats::Bucket>& buckets);

// Summary helpers (hooks/profile_summary.cpp).
ProfileSummary summarize(const std::deque<StepRecord>& records, int64_t params);
std::string format_summary(const ProfileSummary& s);

}  // namespace ddpx::hooks
