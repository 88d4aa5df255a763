// The hook profiler's output side: step 3 of the trace protocol in
// profiler.h. Each rank serialises its events with nlohmann-json; rank 0
// gathers the texts over the process group and writes one Chrome/Perfetto
// trace ({"traceEvents": [...]}, timestamps in microseconds, pid = rank).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "hooks/profiler.h"
#include "plugin/comm/work_wait.h"

namespace ddpx::hooks {
namespace {

using nlohmann::json;

// Every rank's text on every rank: sizes first, then payloads padded to the
// longest (the list form of allgather, which every backend has).
std::vector<std::string> allgather_strings(c10d::ProcessGroup& pg, const std::string& mine) {
  const int n = pg.getSize();
  auto size = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  std::vector<std::vector<at::Tensor>> sizes(1);
  for (int r = 0; r < n; ++r) sizes[0].push_back(at::empty({1}, at::kLong));
  std::vector<at::Tensor> in{size};
  comm::detail::wait_named(pg.allgather(sizes, in));
  int64_t longest = 1;
  for (const auto& s : sizes[0]) longest = std::max(longest, s.item<int64_t>());
  auto payload = at::zeros({longest}, at::kByte);
  std::copy(mine.begin(), mine.end(), reinterpret_cast<char*>(payload.data_ptr<uint8_t>()));
  std::vector<std::vector<at::Tensor>> outs(1);
  for (int r = 0; r < n; ++r) outs[0].push_back(at::empty({longest}, at::kByte));
  std::vector<at::Tensor> pin{payload};
  comm::detail::wait_named(pg.allgather(outs, pin));
  std::vector<std::string> all;
  for (int r = 0; r < n; ++r) {
    const auto* p = reinterpret_cast<const char*>(outs[0][r].data_ptr<uint8_t>());
    all.emplace_back(p, p + sizes[0][r].item<int64_t>());
  }
  return all;
}

json meta(const char* name, int pid, int tid, json args) {
  return {{"name", name}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", std::move(args)}};
}

}  // namespace

std::string Profiler::local_events_json() const {
  std::lock_guard<std::mutex> lock(mu_);
  json out = json::array();
  for (const auto& e : events_) {
    json j = {{"name", e.name}, {"ph", std::string(1, e.ph)}, {"pid", rank_},
              {"tid", e.tid},   {"ts", ts(e.ts_ns)},          {"cat", "ddpx"}};
    if (e.ph == 'X') j["dur"] = static_cast<double>(e.dur_ns) / 1e3;
    if (e.ph == 'i') j["s"] = "t";  // instant scoped to its track
    json args = json::object();
    for (const auto& [k, v] : e.args) args[k] = v;
    j["args"] = std::move(args);
    out.push_back(std::move(j));
  }
  return out.dump();
}

void Profiler::flush(c10d::ProcessGroup* pg) {
  if (!needs_flush()) return;
  flushed_ = true;
  tracing_ = false;
  const std::string mine = local_events_json();
  std::vector<std::string> texts;
  if (pg && world_ > 1) {
    texts = allgather_strings(*pg, mine);
  } else {
    texts.push_back(mine);
  }
  if (rank_ != 0) return;

  json events = json::array();
  for (size_t r = 0; r < texts.size(); ++r) {
    const int pid = static_cast<int>(r);
    events.push_back(meta("process_name", pid, 0, {{"name", "rank " + std::to_string(r)}}));
    events.push_back(meta("process_sort_index", pid, 0, {{"sort_index", pid}}));
    std::vector<int> tids;
    for (auto& e : json::parse(texts[r])) {
      tids.push_back(e["tid"].get<int>());
      events.push_back(std::move(e));
    }
    std::sort(tids.begin(), tids.end());
    tids.erase(std::unique(tids.begin(), tids.end()), tids.end());
    for (int tid : tids) {
      const std::string name =
          tid == 0     ? "step"
          : tid < 1000 ? "hooks" + (tid > 100 ? " lane " + std::to_string(tid - 99) : "")
                       : "channel " + std::to_string((tid - 1000) % 100) +
                             (tid >= 1100 ? " lane " + std::to_string((tid - 1000) / 100 + 1) : "");
      events.push_back(meta("thread_name", pid, tid, {{"name", name}}));
      events.push_back(meta("thread_sort_index", pid, tid, {{"sort_index", tid}}));
    }
  }
  json doc = {{"traceEvents", std::move(events)},
              {"displayTimeUnit", "ms"},
              {"otherData",
               {{"producer", "ddpx GradSync"},
                {"world", world_},
                {"ranks_gathered", static_cast<int>(texts.size())},
                {"first_step", cfg_.first_step},
                {"last_step", std::min<int64_t>(cfg_.last_step, last_finished_)},
                {"params", params_}}}};
  file_ << doc.dump() << '\n';
  file_.close();
  TORCH_CHECK(!file_.fail(), "GradSync: writing the trace file '", cfg_.path, "' failed");
}

}  // namespace ddpx::hooks
