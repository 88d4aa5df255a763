// The codec base: state and stats, the registry behind make_codec, and the
// helpers of codec_util.h.
#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "plugin/comm/backend_registry.h"
#include "plugin/comm/codec_util.h"
#include "plugin/comm/host_stage.h"
#include "plugin/comm/issue_notice.h"
#include "plugin/comm/wire_span.h"
#include "plugin/comm/work_wait.h"

namespace ddpx::comm {
namespace detail {

namespace {
thread_local WireSpan* tls_wire_span = nullptr;
}  // namespace

WireSpan* set_thread_wire_span(WireSpan* span) {
  WireSpan* prev = tls_wire_span;
  tls_wire_span = span;
  return prev;
}
WireSpan* thread_wire_span() { return tls_wire_span; }

namespace {

std::map<std::string, CodecEntry>& registry() {
  static std::map<std::string, CodecEntry> r;
  return r;
}
std::mutex& registry_mu() {
  static std::mutex m;
  return m;
}

// FNV-1a: a hash that is the same in every process (std::hash need not be).
int64_t stable_hash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h >> 2);  // 62 bits: the negation cannot overflow
}

std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.scalar_type() << t.sizes();
  return os.str();
}

}  // namespace

bool register_codec(CodecEntry entry) {
  std::lock_guard<std::mutex> lock(registry_mu());
  registry()[entry.name] = std::move(entry);
  return true;
}

double parse_double(const std::string& arg, const std::string& what) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(arg, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == arg.size() && !arg.empty() && std::isfinite(v), "ddpx codec: ", what,
              " must be a number, got '", arg, "'\n", codec_grammar());
  return v;
}

int64_t parse_int(const std::string& arg, const std::string& what) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(arg, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == arg.size() && !arg.empty(), "ddpx codec: ", what,
              " must be an integer, got '", arg, "'\n", codec_grammar());
  return v;
}

void check_input(const at::Tensor& input, const std::string& spec) {
  TORCH_CHECK(input.defined(), "ddpx codec '", spec, "': input is an undefined tensor");
  TORCH_CHECK(input.layout() == at::kStrided, "ddpx codec '", spec,
              "': input must be a dense (strided) tensor, got layout ", input.layout());
  const auto st = input.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16,
              "ddpx codec '", spec, "': input must be float32, float64, float16 or bfloat16, got ",
              st);
}

void check_packed(const at::Tensor& flat, const std::vector<std::vector<int64_t>>& shapes,
                  const std::string& spec) {
  check_input(flat, spec);
  TORCH_CHECK(flat.dim() == 1, "ddpx codec '", spec, "': a packed input must be 1-D, got ",
              flat.sizes());
  int64_t total = 0;
  for (const auto& s : shapes) {
    int64_t numel = 1;
    for (int64_t d : s) {
      TORCH_CHECK(d >= 0, "ddpx codec '", spec,
                  "': a part's shape has a negative size: ", c10::IntArrayRef(s));
      numel *= d;
    }
    total += numel;
  }
  TORCH_CHECK(total == flat.numel(), "ddpx codec '", spec, "': the parts' shapes hold ", total,
              " elements but the packed input has ", flat.numel());
}

int64_t check_agreement(c10d::ProcessGroup& pg, const at::Tensor& input, const std::string& spec,
                        const std::string& key, const std::string& layout) {
  std::ostringstream shape;
  shape << input.sizes() << layout;
  const int64_t fields[6] = {input.numel(),     static_cast<int64_t>(input.scalar_type()),
                             input.dim(),       stable_hash(shape.str()),
                             stable_hash(spec), stable_hash(key)};
  // [fields, -fields] under MAX: every rank agrees iff max == -max(-x) = min.
  auto fp = at::empty({12}, at::kLong);
  auto* p = fp.data_ptr<int64_t>();
  for (int i = 0; i < 6; ++i) {
    p[i] = fields[i];
    p[6 + i] = -fields[i];
  }
  // On the host where the group takes host tensors for this device's
  // (Gloo; ddpx_mpi): no device round trip, and no sync, per call.
  const bool on_host = input.is_cpu() || stages_through_host(pg, input.device().type());
  at::Tensor dev = on_host ? fp : fp.to(input.device());
  std::vector<at::Tensor> v{dev};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  {
    WireScope agreement(/*payload=*/false);
    detail::wait_named(pg.allreduce(v, o));
  }
  auto got = v[0].cpu();
  const auto* g = got.data_ptr<int64_t>();
  static const char* names[6] = {"numel", "dtype", "ndim", "shape", "codec", "key"};
  std::string bad;
  for (int i = 0; i < 6; ++i) {
    if (g[i] != -g[6 + i]) bad += (bad.empty() ? "" : ", ") + std::string(names[i]);
  }
  TORCH_CHECK(bad.empty(), "ddpx codec '", spec, "': the ranks disagree on the ", bad,
              " of this call (rank ", pg.getRank(), " has ", shape_str(input), ", key '", key,
              "'); every rank must call it with the same shape, dtype, codec and key, in the "
              "same order");
  return fp.nbytes();
}

std::vector<int64_t> agree_on_part_numels(c10d::ProcessGroup& pg, const at::Tensor& flat,
                                          const std::vector<std::vector<int64_t>>& shapes,
                                          const std::string& spec, const std::string& key,
                                          int64_t* bytes, const std::string& more_layout) {
  check_packed(flat, shapes, spec);
  std::vector<int64_t> parts;
  std::string layout;
  for (const auto& s : shapes) {
    parts.push_back(c10::multiply_integers(s));
    layout += std::to_string(parts.back()) + ",";
  }
  *bytes = check_agreement(pg, flat, spec, key, layout + more_layout);
  return parts;
}

int64_t allreduce_sum(c10d::ProcessGroup& pg, at::Tensor& t, int64_t stage_chunk_bytes) {
  TORCH_INTERNAL_ASSERT(t.is_contiguous());
  WireScope wire;
  // Starts x's all-reduce; returns the wait for it.
  const auto start = [&pg](at::Tensor& x) -> std::function<void()> {
    std::vector<at::Tensor> v{x};
    auto work = pg.allreduce(v, c10d::AllreduceOptions{});
    return [work] { detail::wait_named(work); };
  };
  // (One rank: nothing goes on the wire, so nothing to stage.)
  if (stage_chunk_bytes > 0 && t.numel() > 0 && pg.getSize() > 1 && !t.is_cpu() &&
      stages_through_host(pg, t.device().type())) {
    const int64_t chunk =
        std::max<int64_t>(1, stage_chunk_bytes / static_cast<int64_t>(t.element_size()));
    const int64_t chunks = stage_chunk_count(t.numel(), chunk);
    if (auto* span = thread_wire_span()) span->staged_chunks += chunks;
    const c10::Stream stream = c10::impl::VirtualGuardImpl(t.device().type()).getStream(t.device());
    int64_t started = 0;
    const auto start_and_tell = [&](at::Tensor& x) {
      auto wait = start(x);
      if (++started == chunks) notify_last_issue();  // (issue_notice.h)
      return wait;
    };
    staged_reduce(stream, t, thread_host_buffer(t, stream), chunk, async_copy(), start_and_tell);
  } else {
    const auto wait = start(t);
    notify_last_issue();
    wait();
  }
  return t.nbytes();
}

c10::intrusive_ptr<c10d::Work> start_allgather_rows(c10d::ProcessGroup& pg, const at::Tensor& flat,
                                                    at::Tensor* rows, int64_t* bytes) {
  TORCH_INTERNAL_ASSERT(flat.dim() == 1 && flat.is_contiguous());
  const int64_t n = pg.getSize();
  *rows = at::empty({n, flat.numel()}, flat.options());
  // The list form: every backend has it (Gloo lacks _allgather_base). Rows of
  // one buffer, so decoding reads a single [world, L] tensor.
  std::vector<std::vector<at::Tensor>> outs(1);
  for (int64_t r = 0; r < n; ++r) outs[0].push_back((*rows)[r]);
  std::vector<at::Tensor> ins{flat};
  *bytes += flat.nbytes();
  return pg.allgather(outs, ins, c10d::AllgatherOptions{});
}

at::Tensor allgather_rows(c10d::ProcessGroup& pg, const at::Tensor& flat, int64_t* bytes) {
  at::Tensor out;
  WireScope wire;
  detail::wait_named(start_allgather_rows(pg, flat, &out, bytes));
  return out;
}

at::Tensor flat_float(const at::Tensor& input) {
  at::Tensor flat = input.reshape(-1);
  if (flat.scalar_type() == at::kFloat && flat.is_contiguous()) return flat;
  return flat.to(at::kFloat).contiguous();
}

at::Tensor LossyCodec::residual(const std::string& key, const at::Tensor& x) {
  if (key.empty()) return {};
  at::Tensor e = state(key, "residual");
  if (!e.defined()) {
    e = at::zeros({x.numel()}, x.options().dtype(at::kFloat));
    set_state(key, "residual", e);
  }
  // Same history on every rank (agreement passed), so this fails everywhere.
  TORCH_CHECK(e.numel() == x.numel() && e.device() == x.device(), "ddpx codec '", spec(),
              "': key '", key, "' holds a residual of ", e.numel(), " elements on ", e.device(),
              " but the input has ", x.numel(), " on ", x.device(),
              "; use one key per tensor or reset_state(key)");
  return e;
}

at::Tensor to_output(const at::Tensor& flat, const at::Tensor& input) {
  return flat.to(input.scalar_type()).view(input.sizes());
}

}  // namespace detail

at::Tensor Codec::allreduce_mean_packed(const at::Tensor& flat,
                                        const std::vector<std::vector<int64_t>>& shapes,
                                        const std::string& key, c10d::ProcessGroup& pg,
                                        const std::vector<std::string>& /*part_keys*/) {
  detail::check_packed(flat, shapes, spec());
  return allreduce_mean(flat, key, pg);  // element-wise: the parts' shapes do not matter
}

CodecStats Codec::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Codec::reset_state(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (key.empty()) {
    state_.clear();
  } else {
    state_.erase(key);
  }
}

std::map<std::string, at::Tensor> Codec::take_residuals() {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, at::Tensor> out;
  for (auto& [key, slots] : state_) {
    auto it = slots.find("residual");
    if (it != slots.end() && it->second.defined()) out.emplace(key, std::move(it->second));
  }
  // The warm starts belong to their parts, not to the keys' packing: kept.
  for (auto it = state_.begin(); it != state_.end();) {
    auto& slots = it->second;
    for (auto s = slots.begin(); s != slots.end();) s = s->first == kWarm ? std::next(s) : slots.erase(s);
    it = slots.empty() ? state_.erase(it) : std::next(it);
  }
  return out;
}

std::map<std::string, at::Tensor> Codec::warm_starts() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, at::Tensor> out;
  for (const auto& [key, slots] : state_) {
    auto it = slots.find(kWarm);
    if (it != slots.end() && it->second.defined()) out.emplace(key, it->second.clone());
  }
  return out;
}

void Codec::load_warm_starts(const std::map<std::string, at::Tensor>& by_part_key) {
  for (const auto& [key, q] : by_part_key) {
    TORCH_CHECK(!key.empty(), "Codec::load_warm_starts: a warm start needs a part key");
    TORCH_CHECK(q.dim() == 2, "Codec::load_warm_starts: part key '", key,
                "': a warm start is a matrix, got ", q.dim(), " dimensions");
    set_state(key, kWarm, q.to(at::kFloat).contiguous().clone());
  }
}

std::map<std::string, at::Tensor> Codec::residuals() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, at::Tensor> out;
  for (const auto& [key, slots] : state_) {
    auto it = slots.find("residual");
    if (it != slots.end() && it->second.defined()) out.emplace(key, it->second.clone());
  }
  return out;
}

at::Tensor Codec::state(const std::string& key, const std::string& slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = state_.find(key);
  if (it == state_.end()) return {};
  auto s = it->second.find(slot);
  return s == it->second.end() ? at::Tensor() : s->second;
}

void Codec::set_state(const std::string& key, const std::string& slot, const at::Tensor& value) {
  std::lock_guard<std::mutex> lock(mu_);
  state_[key][slot] = value;
}

void Codec::count_call(int64_t bytes_sent, int64_t numel) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.calls += 1;
  stats_.bytes_sent += bytes_sent;
  stats_.bytes_raw += 4 * numel;
}

void Codec::count_bytes(int64_t bytes_sent) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_sent += bytes_sent;
}

std::string codec_grammar() {
  std::lock_guard<std::mutex> lock(detail::registry_mu());
  std::string s = "valid codecs:";
  for (const auto& [name, e] : detail::registry()) s += "\n  " + e.grammar;
  return s;
}

std::unique_ptr<Codec> make_codec(const std::string& spec) {
  const auto colon = spec.find(':');
  const std::string name = spec.substr(0, colon);
  std::optional<std::string> arg;
  if (colon != std::string::npos) arg = spec.substr(colon + 1);
  std::function<std::unique_ptr<Codec>(const std::optional<std::string>&)> make;
  {
    std::lock_guard<std::mutex> lock(detail::registry_mu());
    auto it = detail::registry().find(name);
    if (it != detail::registry().end()) make = it->second.make;
  }
  TORCH_CHECK(make, "ddpx: unknown codec '", spec, "'; ", codec_grammar());
  return make(arg);
}

}  // namespace ddpx::comm
