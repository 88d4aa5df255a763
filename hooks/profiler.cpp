// The hook profiler's recording side: configuration, the construction-time
// agreement, per-step records and the events of traced steps. Writing the
// trace is in trace_writer.cpp, the summary in profile_summary.cpp.
#include "hooks/profiler.h"
#include "plugin/comm/work_wait.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>

namespace ddpx::hooks {
namespace {

constexpr size_t kMaxRecords = 100000;  // summary memory stays bounded on long runs

// The first lane of a track whose last span ended by `begin` (a new lane if
// none), now busy until `end`: spans taken in order of their begin nest.
size_t take_lane(std::vector<int64_t>& lane_end, int64_t begin, int64_t end) {
  size_t lane = 0;
  while (lane < lane_end.size() && lane_end[lane] > begin) ++lane;
  if (lane == lane_end.size()) lane_end.push_back(0);
  lane_end[lane] = end;
  return lane;
}

int64_t ns_of(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

int64_t parse_step(const std::string& text, const std::string& what, int64_t dflt) {
  if (text.empty()) return dflt;
  size_t used = 0;
  long long v = -1;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == text.size() && v >= 1, "GradSync: ", what,
              " must be 'a:b' with steps >= 1 (1-based, inclusive), 'a:' or ':b'; got '", text,
              "'");
  return v;
}

}  // namespace

double comm_wall_us(const std::vector<StepStats::Bucket>& buckets) {
  std::vector<std::pair<double, double>> iv;
  for (const auto& b : buckets) {
    iv.emplace_back(b.launch_us, b.complete_us);
    if (b.gathered_us >= 0) iv.emplace_back(b.gather_us, b.gathered_us);
  }
  std::sort(iv.begin(), iv.end());
  double total = 0, end = -1e300;
  for (const auto& [a, e] : iv) {
    if (e <= end) continue;
    total += e - std::max(a, end);
    end = e;
  }
  return total;
}

TraceConfig TraceConfig::from(const GradSyncOptions& o) {
  TraceConfig c;
  c.path = o.trace_;
  if (c.path.empty()) {
    const char* env = std::getenv("DDPX_TRACE");
    if (env) c.path = env;
  }
  std::string steps = o.trace_steps_, what = "trace_steps";
  if (steps.empty()) {
    const char* env = std::getenv("DDPX_TRACE_STEPS");
    if (env && *env) {
      steps = env;
      what = "DDPX_TRACE_STEPS";
    }
  }
  if (!steps.empty()) {
    const auto colon = steps.find(':');
    TORCH_CHECK(colon != std::string::npos, "GradSync: ", what,
                " must be 'a:b' (1-based, inclusive), 'a:' or ':b'; got '", steps, "'");
    c.first_step = parse_step(steps.substr(0, colon), what, 1);
    c.last_step = parse_step(steps.substr(colon + 1), what, std::numeric_limits<int64_t>::max());
    TORCH_CHECK(c.first_step <= c.last_step, "GradSync: ", what, " '", steps,
                "' is empty (first step after last)");
  }
  return c;
}

ReduceScope::ReduceScope(const LaunchContext& ctx) {
  if (ctx.tls) tls_.emplace(*ctx.tls);
  rf_.emplace(at::RecordScope::USER_SCOPE);
  if (rf_->isActive()) {
    rf_->before(std::string(ctx.gather ? "ddpx::gather" : "ddpx::allreduce") + "[bucket" +
                std::to_string(ctx.bucket) + "]");
  }
  if (BucketTrace* s = ctx.slot) {
    *(ctx.gather ? &s->gather_begin_ns : &s->run_begin_ns) = comm::detail::steady_ns();
    end_ns_ = ctx.gather ? &s->gather_end_ns : &s->run_end_ns;
    prev_ = comm::detail::set_thread_wire_span(ctx.gather ? &s->gather_wire : &s->wire);
  }
}

ReduceScope::~ReduceScope() {
  if (end_ns_) {
    comm::detail::set_thread_wire_span(prev_);
    *end_ns_ = comm::detail::steady_ns();
  }
  rf_.reset();
  tls_.reset();
}

Profiler::Profiler(TraceConfig cfg, int rank, int world, int64_t params)
    : cfg_(std::move(cfg)),
      rank_(rank),
      world_(world),
      params_(params),
      enabled_(!cfg_.path.empty()),
      anchor_(Clock::now()) {}

Profiler::~Profiler() = default;

void Profiler::agree(c10d::ProcessGroup& pg) {
  std::string why;
  if (enabled_ && rank_ == 0) {
    file_.open(cfg_.path, std::ios::out | std::ios::trunc);
    if (!file_) why = std::strerror(errno);
  }
  // [x, -x] under MAX: every rank agrees iff max(x) == min(x).
  const int64_t last = std::min<int64_t>(cfg_.last_step, int64_t{1} << 60);
  const int64_t mine[4] = {enabled_ ? 1 : 0, cfg_.first_step, last, why.empty() ? 0 : 1};
  auto t = at::empty({8}, at::kLong);
  auto* p = t.data_ptr<int64_t>();
  for (int i = 0; i < 4; ++i) p[i] = mine[i], p[4 + i] = -mine[i];
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  comm::detail::wait_named(pg.allreduce(v, o));
  anchor_ = Clock::now();
  TORCH_CHECK(p[3] == 0, "GradSync: cannot write the trace file '", cfg_.path,
              "' (GradSyncOptions::trace / DDPX_TRACE)",
              rank_ == 0 ? ": " + why : std::string(" on rank 0, which writes it"));
  TORCH_CHECK(p[0] == -p[4],
              "GradSync: tracing is on for some ranks only (DDPX_TRACE / "
              "GradSyncOptions::trace must be set on every rank or on none); rank ",
              rank_, enabled_ ? " traces" : " does not");
  TORCH_CHECK(p[1] == -p[5] && p[2] == -p[6],
              "GradSync: the ranks trace different steps "
              "(DDPX_TRACE_STEPS / trace_steps must be the same on every rank); rank ",
              rank_, " traces ", cfg_.first_step, ":", cfg_.last_step);
}

double Profiler::ts(int64_t ns) const { return static_cast<double>(ns - ns_of(anchor_)) / 1e3; }
double Profiler::ts(Clock::time_point t) const { return ts(ns_of(t)); }

void Profiler::begin_step(int64_t step, Clock::time_point t0, int buckets) {
  step_ = step;
  step_open_ = true;
  tracing_ = enabled_ && !flushed_ && step >= cfg_.first_step && step <= cfg_.last_step;
  if (tracing_) buckets_.assign(buckets, BucketTrace{});
}

void Profiler::on_hook(int bucket, Clock::time_point h0, Clock::time_point h1) {
  auto& b = buckets_[bucket];
  const int64_t a = ns_of(h0), e = ns_of(h1);
  if (b.hook_first_ns < 0) b.hook_first_ns = a;
  b.hook_last_ns = std::max(b.hook_last_ns, e);
  b.hook_cpu_ns += e - a;
  ++b.hooks;
}

LaunchContext Profiler::launch_context(int bucket, bool gather) {
  LaunchContext ctx;
  ctx.bucket = bucket;
  ctx.gather = gather;
  if (tracing_) ctx.slot = &buckets_[bucket];
  // torch.profiler listens through thread-local callbacks: hand them over.
  if (at::hasThreadLocalCallbacks()) ctx.tls = std::make_shared<at::ThreadLocalState>();
  return ctx;
}

void Profiler::end_step(const StepStats& s, const FinalTimes& t, double hooks_only_us,
                        const comm::CodecStats& wire_total) {
  StepRecord r;
  r.step = s.step;
  r.backward_us = s.backward_us;
  r.comm_us = comm_wall_us(s.buckets);
  // NextForward: what the step exposes is the end of backward plus the
  // forward's waits at gates (recorded with the step after them).
  r.gate_wait_us = s.gate_wait_us;
  r.memory_wait_us = s.memory_wait_us;
  for (const auto& b : s.buckets) {
    r.held_buckets += b.held ? 1 : 0;
    r.overtaken_bytes += b.held_bytes;
  }
  r.exposed_us = s.exposed_comm_us + s.gate_wait_us;
  r.hook_cpu_us = s.hook_cpu_us;
  r.hooks_only_us = hooks_only_us;
  r.hook_calls = s.hook_calls;
  r.bytes_sent = wire_total.bytes_sent - wire_before_.bytes_sent;
  r.bytes_raw = wire_total.bytes_raw - wire_before_.bytes_raw;
  r.replans = s.replans - replans_before_;
  r.mispredictions = s.unused_mispredictions;
  wire_before_ = wire_total;
  replans_before_ = s.replans;
  {
    std::lock_guard<std::mutex> lock(mu_);
    records_.push_back(r);
    if (records_.size() > kMaxRecords) records_.pop_front();
  }
  if (tracing_) record_step_events(s, t, r);
  tracing_ = false;
  step_open_ = false;
  last_finished_ = s.step;
}

void Profiler::record_step_events(const StepStats& s, const FinalTimes& t, const StepRecord& r) {
  const int64_t t0 = ns_of(t.t0);
  auto at_us = [t0](double us) { return t0 + static_cast<int64_t>(us * 1e3); };
  const double step = static_cast<double>(s.step);
  std::vector<Event> ev;
  auto span = [&](std::string name, int tid, int64_t a, int64_t b) -> Event& {
    ev.push_back({std::move(name), 'X', tid, a, std::max<int64_t>(b - a, 0), {{"step", step}}});
    return ev.back();
  };
  span("ddpx::backward", 0, t0, ns_of(t.begin));
  span("ddpx::final_callback", 0, ns_of(t.begin), ns_of(t.end));
  span("ddpx::final_wait", 0, ns_of(t.wait_begin), ns_of(t.wait_end));
  span("ddpx::write_back", 0, ns_of(t.wait_end), ns_of(t.end));
  ev.push_back({"ddpx::step_stats",
                'i',
                0,
                ns_of(t.end),
                0,
                {{"step", step},
                 {"backward_us", r.backward_us},
                 {"comm_us", r.comm_us},
                 {"exposed_comm_us", r.exposed_us},
                 {"hook_cpu_us", r.hook_cpu_us},
                 {"hooks_only_us", r.hooks_only_us},
                 {"hook_calls", static_cast<double>(r.hook_calls)},
                 {"bytes_sent", static_cast<double>(r.bytes_sent)},
                 {"bytes_raw", static_cast<double>(r.bytes_raw)},
                 {"replans", static_cast<double>(r.replans)},
                 {"unused_mispredictions", static_cast<double>(r.mispredictions)},
                 {"buckets", static_cast<double>(s.buckets.size())},
                 {"params", static_cast<double>(params_)}}});
  if (r.replans > 0) ev.push_back({"ddpx::replan", 'i', 0, ns_of(t.end), 0, {{"step", step}}});

  // Hooks, one event per bucket; a bucket whose hooks overlap an earlier
  // one's (arrivals out of plan order) goes to the next free lane, so every
  // track nests properly.
  std::vector<int> by_first;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (buckets_[b].hooks > 0) by_first.push_back(static_cast<int>(b));
  }
  std::sort(by_first.begin(), by_first.end(),
            [&](int x, int y) { return buckets_[x].hook_first_ns < buckets_[y].hook_first_ns; });
  std::vector<int64_t> lane_end;
  for (int b : by_first) {
    const auto& bt = buckets_[b];
    const size_t lane = take_lane(lane_end, bt.hook_first_ns, bt.hook_last_ns);
    auto& e = span("ddpx::hooks[bucket" + std::to_string(b) + "]", 100 + static_cast<int>(lane),
                   bt.hook_first_ns, bt.hook_last_ns);
    e.args.push_back({"bucket", b});
    e.args.push_back({"calls", static_cast<double>(bt.hooks)});
    e.args.push_back({"cpu_us", static_cast<double>(bt.hook_cpu_ns) / 1e3});
  }

  // Buckets on their channel's track: ready and launch instants, then the run.
  // Runs in flight together on one channel (calls_in_flight) go to the
  // channel's next free lane, 100 tids on, so every track nests properly.
  std::vector<size_t> by_run(s.buckets.size());
  std::iota(by_run.begin(), by_run.end(), size_t{0});
  std::sort(by_run.begin(), by_run.end(), [&](size_t x, size_t y) {
    return buckets_[s.buckets[x].index].run_begin_ns < buckets_[s.buckets[y].index].run_begin_ns;
  });
  std::vector<int> run_tid(s.buckets.size());
  std::map<int, std::vector<int64_t>> run_lane_end;  // per channel
  for (size_t i : by_run) {
    const auto& bt = buckets_[s.buckets[i].index];
    const size_t lane = take_lane(run_lane_end[s.buckets[i].channel], bt.run_begin_ns,
                                  std::max(bt.run_end_ns, bt.gather_end_ns));
    run_tid[i] = 1000 + s.buckets[i].channel + 100 * static_cast<int>(lane);
  }
  for (size_t i = 0; i < s.buckets.size(); ++i) {
    const auto& b = s.buckets[i];
    const auto& bt = buckets_[b.index];
    const int tid = run_tid[i];
    const std::string tag = "[bucket" + std::to_string(b.index) + "]";
    const int64_t ready = at_us(b.ready_us), launch = at_us(b.launch_us),
                  complete = at_us(b.complete_us);
    ev.push_back({"ddpx::ready" + tag, 'i', tid, ready, 0, {{"step", step}}});
    ev.push_back({"ddpx::launch" + tag, 'i', tid, launch, 0, {{"step", step}}});
    auto& run = span("ddpx::allreduce" + tag, tid, bt.run_begin_ns, bt.run_end_ns);
    run.args.push_back({"bucket", b.index});
    run.args.push_back({"bytes", static_cast<double>(b.bytes)});
    run.args.push_back({"ready", ts(ready)});
    run.args.push_back({"launch", ts(launch)});
    run.args.push_back({"complete", ts(complete)});
    // How the bytes reached the wire: staged through host memory in this
    // many chunks, or 0: the backend got the bucket itself (host memory, or
    // device memory that NCCL or a CUDA-aware MPI reduces in place).
    run.args.push_back({"staged_chunks", static_cast<double>(bt.wire.staged_chunks)});
    if (bt.wire.first_begin_ns >= 0) {
      span("ddpx::encode", tid, bt.run_begin_ns, bt.wire.first_begin_ns);
      span("ddpx::wire", tid, bt.wire.first_begin_ns, bt.wire.last_end_ns);
      span("ddpx::decode", tid, bt.wire.last_end_ns, bt.run_end_ns);
    }
    // Sharded: the gather of the bucket's updated parts (its own wire span).
    if (bt.gather_begin_ns >= 0) {
      auto& g = span("ddpx::gather" + tag, tid, bt.gather_begin_ns, bt.gather_end_ns);
      g.args.push_back({"bucket", b.index});
      if (bt.gather_wire.first_begin_ns >= 0) {
        span("ddpx::wire", tid, bt.gather_wire.first_begin_ns, bt.gather_wire.last_end_ns);
      }
    }
  }
  span("ddpx::step_agreement", 1000, ns_of(t.agree_begin), ns_of(t.agree_end));
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& e : ev) events_.push_back(std::move(e));
}

void Profiler::phase(const std::string& name, Clock::time_point begin, Clock::time_point end) {
  const int64_t step = last_finished_.load();
  if (!enabled_ || flushed_ || step < cfg_.first_step || step > cfg_.last_step) return;
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back({"ddpx::" + name,
                     'X',
                     0,
                     ns_of(begin),
                     ns_of(end) - ns_of(begin),
                     {{"step", static_cast<double>(step)}}});
}

bool Profiler::flush_due() const {
  return enabled_ && !flushed_ && last_finished_ > cfg_.last_step;
}

ProfileSummary Profiler::summary() const {
  std::lock_guard<std::mutex> lock(mu_);
  return summarize(records_, params_);
}


}  // namespace ddpx::hooks
