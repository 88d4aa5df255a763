#include "plugin/comm/flight_dump.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/TraceUtils.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>

namespace ddpx::comm::detail {
namespace {

using c10d::new_dict;
using c10d::new_list;

c10::List<c10::IValue> sizes_list(const std::vector<std::vector<int64_t>>& sizes) {
  auto out = new_list();
  for (const auto& s : sizes) {
    auto dims = new_list();
    for (int64_t d : s) dims.push_back(d);
    out.push_back(dims);
  }
  return out;
}

c10::List<c10::IValue> dtypes_list(const std::vector<c10::ScalarType>& dtypes) {
  auto out = new_list();
  for (auto t : dtypes) out.push_back(std::string(c10::toString(t)));
  return out;
}

std::string ranks_text(const std::vector<int64_t>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

int group_rank(const FrGroup& g, int rank) {
  auto it = std::find(g.ranks.begin(), g.ranks.end(), rank);
  return it == g.ranks.end() ? rank : static_cast<int>(it - g.ranks.begin());
}

// --- reading back --------------------------------------------------------

const c10::IValue& field(const c10::Dict<c10::IValue, c10::IValue>& d, const char* key,
                         const std::string& what) {
  auto it = d.find(c10::IValue(std::string(key)));
  TORCH_CHECK(it != d.end(), what, ": not a flight-recorder dump (no \"", key, "\")");
  return it->value();
}

std::optional<c10::IValue> maybe(const c10::Dict<c10::IValue, c10::IValue>& d, const char* key) {
  auto it = d.find(c10::IValue(std::string(key)));
  if (it == d.end() || it->value().isNone()) return std::nullopt;
  return it->value();
}

std::vector<std::vector<int64_t>> read_sizes(const c10::IValue& v) {
  std::vector<std::vector<int64_t>> out;
  for (const auto& s : v.toListRef()) {
    std::vector<int64_t> dims;
    for (const auto& d : s.toListRef()) dims.push_back(d.toInt());
    out.push_back(std::move(dims));
  }
  return out;
}

c10::ScalarType dtype_named(const std::string& name) {
  for (int i = 0; i < static_cast<int>(c10::ScalarType::NumOptions); ++i) {
    const auto t = static_cast<c10::ScalarType>(i);
    if (name == c10::toString(t)) return t;
  }
  return c10::ScalarType::Undefined;
}

std::vector<c10::ScalarType> read_dtypes(const c10::IValue& v) {
  std::vector<c10::ScalarType> out;
  for (const auto& s : v.toListRef()) out.push_back(dtype_named(s.toStringRef()));
  return out;
}

FrOp op_named(const std::string& name) {
  for (int i = 0; i <= static_cast<int>(FrOp::kOther); ++i) {
    if (name == fr_op_name(static_cast<FrOp>(i))) return static_cast<FrOp>(i);
  }
  return FrOp::kOther;
}

}  // namespace

std::string fr_profiling_name(const FrRecord& r, const std::string& lib, int self) {
  std::string name = lib + ":" + fr_op_name(r.op);
  if (r.op == FrOp::kSend) {
    name += " " + std::to_string(self) + "->" + std::to_string(r.peer);
  } else if (r.op == FrOp::kRecv) {
    name += " " + std::to_string(self) + "<-" + (r.peer < 0 ? "?" : std::to_string(r.peer));
  }
  return name;
}

std::string fr_dump_bytes(const FrSnapshot& snap, int rank, const std::string& comm_lib) {
  auto pg_config = new_dict();
  auto pg_status = new_dict();
  for (size_t g = 0; g < snap.groups.size(); ++g) {
    const auto& grp = snap.groups[g];
    auto info = new_dict();
    info.insert("name", grp.name);
    info.insert("desc", grp.desc);
    info.insert("ranks", ranks_text(grp.ranks));
    pg_config.insert(grp.name, info);
    auto status = new_dict();
    status.insert("last_enqueued_collective", static_cast<int64_t>(snap.status[g].enqueued));
    status.insert("last_started_collective", static_cast<int64_t>(snap.status[g].started));
    status.insert("last_completed_collective", static_cast<int64_t>(snap.status[g].finished));
    pg_status.insert(std::to_string(g), status);
  }
  auto entries = new_list();
  for (const auto& r : snap.records) {
    const bool known = r.group >= 0 && r.group < static_cast<int>(snap.groups.size());
    const FrGroup none{"unknown", "unknown", {}, "ddpx"};
    const FrGroup& grp = known ? snap.groups[r.group] : none;
    auto e = new_dict();
    e.insert("record_id", static_cast<int64_t>(r.id));
    e.insert("pg_id", static_cast<int64_t>(r.group));
    e.insert("process_group", c10::ivalue::Tuple::create(grp.name, grp.desc));
    e.insert("collective_seq_id", static_cast<int64_t>(r.collective_seq));
    e.insert("p2p_seq_id", static_cast<int64_t>(r.p2p_seq));
    e.insert("op_id", static_cast<int64_t>(r.p2p ? r.p2p_seq : r.collective_seq));
    e.insert("profiling_name", fr_profiling_name(r, grp.lib, group_rank(grp, rank)));
    e.insert("time_created_ns", r.created_ns);
    // A call that failed (timed out, or refused by the ranks' agreement) did
    // not complete: it stays "started" (or "scheduled"), retired, as PyTorch
    // shows a collective its watchdog gave up on.
    const bool completed = r.finished_ns != 0 && !r.failed;
    if (r.started_ns != 0 && completed) {
      e.insert("duration_ms", static_cast<double>(r.finished_ns - r.started_ns) / 1e6);
    }
    e.insert("input_sizes", sizes_list(r.input_sizes));
    e.insert("input_dtypes", dtypes_list(r.input_dtypes));
    e.insert("output_sizes", sizes_list(r.output_sizes));
    e.insert("output_dtypes", dtypes_list(r.output_dtypes));
    e.insert("state", std::string(completed      ? "completed"
                                  : r.started_ns ? "started"
                                                 : "scheduled"));
    e.insert("time_discovered_started_ns",
             r.started_ns ? c10::IValue(r.started_ns) : c10::IValue());
    e.insert("time_discovered_completed_ns",
             completed ? c10::IValue(r.finished_ns) : c10::IValue());
    e.insert("retired", r.finished_ns != 0);
    e.insert("timeout_ms", r.timeout_ms);
    e.insert("is_p2p", r.p2p);
    e.insert("thread_id", std::to_string(r.thread_id));
    e.insert("thread_name", r.thread_name);
    e.insert("frames", new_list());
    e.insert("ddpx_failed", r.failed);
    if (r.step >= 0) e.insert("ddpx_step", r.step);
    if (r.bucket >= 0) e.insert("ddpx_bucket", static_cast<int64_t>(r.bucket));
    if (r.names >= 0 && r.names < static_cast<int>(snap.names.size())) {
      auto names = new_list();
      for (const auto& n : snap.names[r.names]) names.push_back(n);
      e.insert("ddpx_params", names);
    }
    entries.push_back(e);
  }
  auto dump = new_dict();
  dump.insert("version", std::string(kFrVersion));
  dump.insert("comm_lib_version", comm_lib);
  dump.insert("pg_config", pg_config);
  dump.insert("pg_status", pg_status);
  dump.insert("entries", entries);
  dump.insert("ddpx_rank", static_cast<int64_t>(rank));
  return c10d::pickle_str(dump);
}

FrDump fr_parse_dump(const std::string& bytes, const std::string& what) {
  c10::IValue v;
  try {
    v = torch::jit::unpickle(bytes.data(), bytes.size());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, what, ": not a flight-recorder dump (", e.what(), ")");
  }
  TORCH_CHECK(v.isGenericDict(), what, ": not a flight-recorder dump (not a dict)");
  const auto dump = v.toGenericDict();
  FrDump out;
  if (auto r = maybe(dump, "ddpx_rank")) out.rank = static_cast<int>(r->toInt());
  // Groups by name; the analyzer keys them so.
  std::map<std::string, int> by_name;
  for (const auto& kv : field(dump, "pg_config", what).toGenericDict()) {
    const auto info = kv.value().toGenericDict();
    FrGroup g;
    g.name = kv.key().toStringRef();
    g.desc = field(info, "desc", what).toStringRef();
    std::string ranks = field(info, "ranks", what).toStringRef();
    std::replace(ranks.begin(), ranks.end(), ',', ' ');
    ranks.erase(
        std::remove_if(ranks.begin(), ranks.end(), [](char c) { return c == '[' || c == ']'; }),
        ranks.end());
    std::istringstream in(ranks);
    for (int64_t r; in >> r;) g.ranks.push_back(r);
    by_name[g.name] = static_cast<int>(out.snap.groups.size());
    out.snap.groups.push_back(std::move(g));
  }
  out.snap.status.resize(out.snap.groups.size());
  for (const auto& ev : field(dump, "entries", what).toListRef()) {
    const auto e = ev.toGenericDict();
    FrRecord r;
    r.id = static_cast<uint64_t>(field(e, "record_id", what).toInt());
    const auto pg = field(e, "process_group", what).toTupleRef().elements();
    auto g = by_name.find(pg.at(0).toStringRef());
    r.group = g == by_name.end() ? -1 : g->second;
    r.collective_seq = static_cast<uint64_t>(field(e, "collective_seq_id", what).toInt());
    r.p2p_seq = static_cast<uint64_t>(field(e, "p2p_seq_id", what).toInt());
    r.p2p = field(e, "is_p2p", what).toBool();
    const std::string profiling = field(e, "profiling_name", what).toStringRef();
    const auto colon = profiling.rfind(':');
    const std::string lib = profiling.substr(0, colon == std::string::npos ? 0 : colon);
    std::string op = colon == std::string::npos ? profiling : profiling.substr(colon + 1);
    const auto space = op.find(' ');
    if (space != std::string::npos) {
      const std::string peers = op.substr(space + 1);
      op = op.substr(0, space);
      const auto arrow = peers.find_first_of("-<");
      const std::string other = peers.substr(std::min(peers.size(), arrow + 2));
      r.peer = other == "?" || other.empty() ? -1 : std::stoi(other);
    }
    r.op = op_named(op);
    if (r.group >= 0 && out.snap.groups[r.group].lib.empty()) out.snap.groups[r.group].lib = lib;
    r.created_ns = field(e, "time_created_ns", what).toInt();
    if (auto t = maybe(e, "time_discovered_started_ns")) r.started_ns = t->toInt();
    if (auto t = maybe(e, "time_discovered_completed_ns")) r.finished_ns = t->toInt();
    if (field(e, "state", what).toStringRef() == "completed" && r.finished_ns == 0) {
      r.finished_ns = r.created_ns;  // a dump that does not say when
    }
    if (auto t = maybe(e, "timeout_ms")) r.timeout_ms = t->toInt();
    r.input_sizes = read_sizes(field(e, "input_sizes", what));
    r.output_sizes = read_sizes(field(e, "output_sizes", what));
    if (auto t = maybe(e, "input_dtypes")) r.input_dtypes = read_dtypes(*t);
    if (auto t = maybe(e, "output_dtypes")) r.output_dtypes = read_dtypes(*t);
    if (auto t = maybe(e, "thread_name")) r.thread_name = t->toStringRef();
    if (auto t = maybe(e, "ddpx_failed")) r.failed = t->toBool();
    if (r.failed && r.finished_ns == 0) r.finished_ns = r.started_ns ? r.started_ns : r.created_ns;
    if (auto t = maybe(e, "ddpx_step")) r.step = t->toInt();
    if (auto t = maybe(e, "ddpx_bucket")) r.bucket = static_cast<int>(t->toInt());
    if (auto t = maybe(e, "ddpx_params")) {
      std::vector<std::string> names;
      for (const auto& n : t->toListRef()) names.push_back(n.toStringRef());
      r.names = static_cast<int>(out.snap.names.size());
      out.snap.names.push_back(std::move(names));
    }
    if (r.group >= 0 && !r.p2p) {
      auto& st = out.snap.status[r.group];
      st.enqueued = std::max(st.enqueued, r.collective_seq);
      if (r.started_ns) st.started = std::max(st.started, r.collective_seq);
      if (r.finished_ns) st.finished = std::max(st.finished, r.collective_seq);
    }
    out.snap.records.push_back(std::move(r));
  }
  return out;
}

void fr_write_file(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp" + std::to_string(getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out, "flight recorder: cannot write ", tmp);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    TORCH_CHECK(out.good(), "flight recorder: cannot write ", tmp);
  }
  TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "flight recorder: cannot rename ", tmp,
              " to ", path);
}

std::string fr_read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "flight recorder: cannot read ", path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace ddpx::comm::detail
