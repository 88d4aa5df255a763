// The hook profiler's summary: per-step medians of the always-on step
// records, and the fixed-width table ddpx-train prints at the end of a run.
// scripts/profile.py computes the same table from a trace.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>

#include "hooks/profiler.h"

namespace ddpx::hooks {
namespace {

// Median of f over the records for which keep holds (0 when none do).
double median(const std::deque<StepRecord>& rs, const std::function<double(const StepRecord&)>& f,
              const std::function<bool(const StepRecord&)>& keep = nullptr) {
  std::vector<double> v;
  for (const auto& r : rs) {
    if (!keep || keep(r)) v.push_back(f(r));
  }
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

}  // namespace

ProfileSummary summarize(const std::deque<StepRecord>& rs, int64_t params) {
  ProfileSummary s;
  s.steps = static_cast<int64_t>(rs.size());
  s.params = params;
  s.backward_us = median(rs, [](const StepRecord& r) { return r.backward_us; });
  s.comm_us = median(rs, [](const StepRecord& r) { return r.comm_us; });
  s.exposed_comm_us = median(rs, [](const StepRecord& r) { return r.exposed_us; });
  s.overlap_efficiency = median(
      rs, [](const StepRecord& r) { return 1.0 - r.exposed_us / r.comm_us; },
      [](const StepRecord& r) { return r.comm_us > 0; });
  s.hook_cpu_us = median(rs, [](const StepRecord& r) { return r.hook_cpu_us; });
  s.gate_wait_us = median(rs, [](const StepRecord& r) { return r.gate_wait_us; });
  s.memory_wait_us = median(rs, [](const StepRecord& r) { return r.memory_wait_us; });
  s.held_buckets =
      median(rs, [](const StepRecord& r) { return static_cast<double>(r.held_buckets); });
  s.overtaken_bytes =
      median(rs, [](const StepRecord& r) { return static_cast<double>(r.overtaken_bytes); });
  s.hook_cpu_per_param_us = median(
      rs, [](const StepRecord& r) { return r.hooks_only_us / static_cast<double>(r.hook_calls); },
      [](const StepRecord& r) { return r.hook_calls > 0; });
  s.bytes_sent = median(rs, [](const StepRecord& r) { return static_cast<double>(r.bytes_sent); });
  s.compression = median(
      rs,
      [](const StepRecord& r) {
        return static_cast<double>(r.bytes_raw) / static_cast<double>(r.bytes_sent);
      },
      [](const StepRecord& r) { return r.bytes_sent > 0; });
  for (const auto& r : rs) {
    s.replans += r.replans;
    s.unused_mispredictions += r.mispredictions;
  }
  return s;
}

std::string format_summary(const ProfileSummary& s) {
  std::string out;
  char line[160];
  std::snprintf(line, sizeof line,
                "ddpx GradSync profile: %lld steps, %lld parameter tensors (medians per step)\n",
                static_cast<long long>(s.steps), static_cast<long long>(s.params));
  out += line;
  auto row = [&](const char* metric, double v, const char* unit) {
    std::snprintf(line, sizeof line, "  %-30s %12.3f  %s\n", metric, v, unit);
    out += line;
  };
  auto count = [&](const char* metric, int64_t v) {
    std::snprintf(line, sizeof line, "  %-30s %12lld  in %lld steps\n", metric,
                  static_cast<long long>(v), static_cast<long long>(s.steps));
    out += line;
  };
  std::snprintf(line, sizeof line, "  %-30s %12s  %s\n", "metric", "value", "unit");
  out += line;
  row("compute (backward)", s.backward_us / 1e3, "ms");
  row("communication", s.comm_us / 1e3, "ms");
  row("exposed communication", s.exposed_comm_us / 1e3, "ms");
  row("overlap efficiency", 100.0 * s.overlap_efficiency, "%");
  if (s.gate_wait_us > 0) row("forward waiting at gates", s.gate_wait_us / 1e3, "ms");
  if (s.memory_wait_us > 0) row("backward waiting for memory", s.memory_wait_us / 1e3, "ms");
  if (s.held_buckets > 0) row("held for priority (pieces)", s.held_buckets, "buckets");
  if (s.overtaken_bytes > 0) row("overtaken by them", s.overtaken_bytes / 1e6, "MB");
  row("hook CPU, total", s.hook_cpu_us / 1e3, "ms");
  row("hook CPU per parameter tensor", s.hook_cpu_per_param_us, "us");
  row("bytes sent", s.bytes_sent / 1e6, "MB");
  row("compression ratio", s.compression, "x");
  if (s.param_bytes > 0) {
    row("memory: parameters", s.param_bytes / 1e6, "MB");
    row("memory: optimizer state", s.optimizer_state_bytes / 1e6, "MB");
    row("memory: gradient buckets, peak", s.grad_buffer_bytes / 1e6, "MB");
  }
  count("re-planning events", s.replans);
  count("unused mispredictions", s.unused_mispredictions);
  return out;
}

}  // namespace ddpx::hooks
