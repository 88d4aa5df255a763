#include "plugin/comm/flight_recorder.h"

#include <ATen/core/Tensor.h>
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <thread>

namespace ddpx::comm::detail {

namespace {

// A stamp (started / finished) is one word, so that a stamp meant for a
// record whose slot was reused meanwhile is refused by compare-and-swap
// rather than written into the newer record:
//   bits 63..40: the record id's low 24 bits (its tag)
//   bit  39:     failed (finished stamps)
//   bits 38..0:  microseconds after the record's creation, + 1 (0: none);
//                2^39 us is 6.4 days.
constexpr int kTagShift = 40;
constexpr uint64_t kFailedBit = uint64_t{1} << 39;
constexpr uint64_t kUsMask = kFailedBit - 1;
constexpr uint64_t kSeqMask = (uint64_t{1} << kTagShift) - 1;  // op_seq: 2^40 calls

uint64_t tag_of(uint64_t id) { return (id & 0xFFFFFF) << kTagShift; }

// The calling thread's name, read once.
struct ThreadName {
  char name[16] = {};
  uint64_t id = 0;
  ThreadName() {
    pthread_getname_np(pthread_self(), name, sizeof(name));
    id = std::hash<std::thread::id>()(std::this_thread::get_id());
  }
};

std::optional<std::string> fr_env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

// PyTorch's getCvar*: the first name that is set wins.
std::optional<std::string> fr_cvar(std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (auto v = fr_env(n)) return v;
  }
  return std::nullopt;
}

}  // namespace

struct FlightRecorder::Slot {
  std::atomic<uint64_t> seq{0};  // 0: empty; 2*id - 1: being written; 2*id: record `id`
  std::atomic<uint64_t> started{0};
  std::atomic<uint64_t> finished{0};
  std::atomic<uint64_t> op_seq{0};  // tag | the call's sequence number (0: not yet known)
  // One writer at a time: held only while record() fills the slot, so it is
  // contended only when the ring laps a writer (capacity newer records
  // claimed while it was between taking its id and writing).
  std::atomic<bool> writing{false};
  // Written under `seq`:
  int group;
  FrOp op;
  bool p2p;
  int peer;
  int64_t created_ns;
  int64_t timeout_ms;
  uint8_t n_in, n_out;
  uint8_t ndim[kMaxTensors];  // 255: not kept (out of dimensions)
  int8_t dtype[kMaxTensors];
  int64_t dims[kMaxDims];
  int64_t step;
  int bucket;
  int names;
  uint64_t thread_id;
  char thread_name[16];
};

const char* fr_op_name(FrOp op) {
  switch (op) {
    case FrOp::kAllReduce:
      return "all_reduce";
    case FrOp::kBroadcast:
      return "broadcast";
    case FrOp::kReduce:
      return "reduce";
    case FrOp::kAllGather:
      return "all_gather";
    case FrOp::kAllGatherBase:
      return "_all_gather_base";
    case FrOp::kAllGatherCoalesced:
      return "all_gather_into_tensor_coalesced";
    case FrOp::kReduceScatter:
      return "reduce_scatter";
    case FrOp::kReduceScatterBase:
      return "_reduce_scatter_base";
    case FrOp::kReduceScatterCoalesced:
      return "reduce_scatter_tensor_coalesced";
    case FrOp::kGather:
      return "gather";
    case FrOp::kScatter:
      return "scatter";
    case FrOp::kAllToAll:
      return "all_to_all";
    case FrOp::kAllToAllBase:
      return "all_to_all_single";
    case FrOp::kBarrier:
      return "barrier";
    case FrOp::kSend:
      return "send";
    case FrOp::kRecv:
      return "recv";
    case FrOp::kCoalesced:
      return "coalesced";
    case FrOp::kOther:
      return "other";
  }
  return "other";
}

FrOp fr_op(c10d::OpType type) {
  using T = c10d::OpType;
  switch (type) {
    case T::ALLREDUCE:
    case T::ALLREDUCE_COALESCED:
      return FrOp::kAllReduce;
    case T::BROADCAST:
      return FrOp::kBroadcast;
    case T::REDUCE:
      return FrOp::kReduce;
    case T::ALLGATHER:
      return FrOp::kAllGather;
    case T::_ALLGATHER_BASE:
      return FrOp::kAllGatherBase;
    case T::ALLGATHER_COALESCED:
      return FrOp::kAllGatherCoalesced;
    case T::REDUCE_SCATTER:
      return FrOp::kReduceScatter;
    case T::_REDUCE_SCATTER_BASE:
      return FrOp::kReduceScatterBase;
    case T::GATHER:
      return FrOp::kGather;
    case T::SCATTER:
      return FrOp::kScatter;
    case T::ALLTOALL:
      return FrOp::kAllToAll;
    case T::ALLTOALL_BASE:
      return FrOp::kAllToAllBase;
    case T::BARRIER:
      return FrOp::kBarrier;
    case T::SEND:
      return FrOp::kSend;
    case T::RECV:
    case T::RECVANYSOURCE:
      return FrOp::kRecv;
    case T::COALESCED:
      return FrOp::kCoalesced;
    default:
      return FrOp::kOther;
  }
}

size_t fr_buffer_size() {
  auto v = fr_cvar({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"});
  if (!v) return 2000;
  try {
    return static_cast<size_t>(std::max<long long>(0, std::stoll(*v)));
  } catch (const std::exception&) {
    return 2000;  // as PyTorch would not: it throws; a trace setting never ends a job here
  }
}

bool fr_dump_on_timeout() {
  auto v = fr_cvar({"TORCH_FR_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT"});
  if (!v) return true;
  return *v == "1" || *v == "true" || *v == "TRUE" || *v == "True" || *v == "y" || *v == "yes";
}

std::string fr_dump_prefix() {
  return fr_cvar({"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"})
      .value_or("/tmp/nccl_trace_rank_");
}

FlightRecorder& FlightRecorder::get() {
  static auto* recorder = new FlightRecorder(fr_buffer_size());  // leaked: see the header
  return *recorder;
}

FlightRecorder::FlightRecorder(size_t capacity)
    : capacity_(capacity), slots_(capacity > 0 ? new Slot[capacity] : nullptr) {}

FlightRecorder::~FlightRecorder() = default;

int64_t FlightRecorder::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

FlightRecorder::Slot* FlightRecorder::slot_of(uint64_t id) const {
  return &slots_[(id - 1) % capacity_];
}

int FlightRecorder::group(const FrGroup& g) {
  std::lock_guard<std::mutex> lock(registry_mu_);
  for (size_t i = 0; i < groups_.size(); ++i) {
    const auto& h = groups_[i];
    if (h.name == g.name && h.desc == g.desc && h.ranks == g.ranks && h.lib == g.lib) {
      return static_cast<int>(i);
    }
  }
  groups_.push_back(g);
  return static_cast<int>(groups_.size() - 1);
}

int FlightRecorder::names(std::vector<std::string> list) {
  std::lock_guard<std::mutex> lock(registry_mu_);
  for (size_t i = 0; i < names_.size(); ++i) {
    if (names_[i] == list) return static_cast<int>(i);
  }
  names_.push_back(std::move(list));
  return static_cast<int>(names_.size() - 1);
}

uint64_t FlightRecorder::record(const Call& call) {
  if (capacity_ == 0 || paused_.load(std::memory_order_relaxed)) return 0;
  thread_local const ThreadName thread;
  const uint64_t id = next_.fetch_add(1, std::memory_order_relaxed);
  Slot& s = *slot_of(id);
  while (s.writing.exchange(true, std::memory_order_acquire)) {
  }
  if (s.seq.load(std::memory_order_relaxed) > 2 * id) {
    // Lapped: a newer record holds the slot (this one is out of the window).
    s.writing.store(false, std::memory_order_release);
    return id;
  }
  s.seq.store(2 * id - 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  s.started.store(tag_of(id), std::memory_order_relaxed);
  s.finished.store(tag_of(id), std::memory_order_relaxed);
  s.op_seq.store(tag_of(id) | (call.seq & kSeqMask), std::memory_order_relaxed);
  s.group = call.group;
  s.op = call.op;
  s.p2p = call.p2p;
  s.peer = call.peer;
  s.created_ns = call.created_ns != 0 ? call.created_ns : now_ns();
  s.timeout_ms = call.timeout_ms;
  s.step = call.step;
  s.bucket = call.bucket;
  s.names = call.names;
  s.thread_id = thread.id;
  std::memcpy(s.thread_name, thread.name, sizeof(s.thread_name));
  int tensors = 0;
  int dims = 0;
  auto keep = [&](at::IntArrayRef sizes, c10::ScalarType dtype) {
    if (tensors == kMaxTensors) return false;
    const bool fits = dims + static_cast<int>(sizes.size()) <= kMaxDims;
    s.ndim[tensors] = fits ? static_cast<uint8_t>(sizes.size()) : 255;
    s.dtype[tensors] = static_cast<int8_t>(dtype);
    if (fits) {
      for (int64_t d : sizes) s.dims[dims++] = d;
    }
    ++tensors;
    return true;
  };
  auto keep_all = [&](const std::vector<at::Tensor>* ts) {
    int n = 0;
    if (call.numel >= 0) {
      const int64_t numel = call.numel;
      n += keep(at::IntArrayRef(&numel, 1), call.dtype);
    } else if (ts != nullptr) {
      for (const auto& t : *ts) {
        if (!t.defined() || !keep(t.sizes(), t.scalar_type())) break;
        ++n;
      }
    }
    return static_cast<uint8_t>(n);
  };
  s.n_in = keep_all(call.inputs);
  s.n_out = keep_all(call.outputs);
  s.seq.store(2 * id, std::memory_order_release);
  s.writing.store(false, std::memory_order_release);
  return id;
}

namespace {
void stamp(std::atomic<uint64_t>& word, uint64_t id, int64_t created_ns, bool failed) {
  const int64_t us = std::max<int64_t>(0, (FlightRecorder::now_ns() - created_ns) / 1000);
  const uint64_t value = tag_of(id) | (failed ? kFailedBit : 0) |
                         std::min<uint64_t>(static_cast<uint64_t>(us) + 1, kUsMask);
  uint64_t expected = tag_of(id);  // this record's, not stamped yet
  word.compare_exchange_strong(expected, value, std::memory_order_relaxed);
}
}  // namespace

void FlightRecorder::set_seq(uint64_t id, uint64_t seq) {
  if (id == 0 || capacity_ == 0) return;
  Slot& s = *slot_of(id);
  uint64_t expected = tag_of(id);  // this record's, not numbered yet
  s.op_seq.compare_exchange_strong(expected, tag_of(id) | (seq & kSeqMask),
                                   std::memory_order_relaxed);
}

void FlightRecorder::started(uint64_t id) {
  if (id == 0 || capacity_ == 0) return;
  Slot& s = *slot_of(id);
  if (s.seq.load(std::memory_order_acquire) != 2 * id) return;
  stamp(s.started, id, s.created_ns, false);
}

void FlightRecorder::finished(uint64_t id, bool failed) {
  if (id == 0 || capacity_ == 0) return;
  Slot& s = *slot_of(id);
  if (s.seq.load(std::memory_order_acquire) != 2 * id) return;
  stamp(s.finished, id, s.created_ns, failed);
}

FrSnapshot FlightRecorder::snapshot() const {
  FrSnapshot out;
  {
    std::lock_guard<std::mutex> lock(registry_mu_);
    out.groups = groups_;
    out.names = names_;
  }
  out.status.resize(out.groups.size());
  if (capacity_ == 0) return out;
  const uint64_t end = next_.load(std::memory_order_acquire);
  const uint64_t begin = end > capacity_ ? end - capacity_ : 1;
  for (uint64_t id = begin; id < end; ++id) {
    const Slot& s = *slot_of(id);
    for (int attempt = 0; attempt < 100; ++attempt) {
      const uint64_t before = s.seq.load(std::memory_order_acquire);
      if (before != 2 * id) {
        if (before == 2 * id - 1) {
          std::this_thread::yield();  // being written
          continue;
        }
        break;  // overwritten by a newer record (or never written: a writer died)
      }
      FrRecord r;
      r.id = id;
      r.group = s.group;
      r.op = s.op;
      r.p2p = s.p2p;
      r.peer = s.peer;
      r.created_ns = s.created_ns;
      r.timeout_ms = s.timeout_ms;
      r.step = s.step;
      r.bucket = s.bucket;
      r.names = s.names;
      r.thread_id = s.thread_id;
      r.thread_name.assign(s.thread_name, strnlen(s.thread_name, sizeof(s.thread_name)));
      int d = 0;
      for (int t = 0; t < s.n_in + s.n_out && t < kMaxTensors; ++t) {
        std::vector<int64_t> sizes;
        if (s.ndim[t] != 255) {
          sizes.assign(s.dims + d, s.dims + d + s.ndim[t]);
          d += s.ndim[t];
        }
        const auto dtype = static_cast<c10::ScalarType>(s.dtype[t]);
        (t < s.n_in ? r.input_sizes : r.output_sizes).push_back(std::move(sizes));
        (t < s.n_in ? r.input_dtypes : r.output_dtypes).push_back(dtype);
      }
      const uint64_t started = s.started.load(std::memory_order_relaxed);
      const uint64_t finished = s.finished.load(std::memory_order_relaxed);
      (r.p2p ? r.p2p_seq : r.collective_seq) = s.op_seq.load(std::memory_order_relaxed) & kSeqMask;
      std::atomic_thread_fence(std::memory_order_acquire);
      if (s.seq.load(std::memory_order_relaxed) != before) continue;  // rewritten meanwhile
      auto at = [&](uint64_t word) -> int64_t {
        const uint64_t us = word & kUsMask;
        return us == 0 ? 0 : r.created_ns + static_cast<int64_t>(us - 1) * 1000;
      };
      r.started_ns = at(started);
      r.finished_ns = at(finished);
      r.failed = (finished & kFailedBit) != 0;
      if (r.group >= 0 && r.group < static_cast<int>(out.status.size()) && !r.p2p) {
        auto& st = out.status[r.group];
        st.enqueued = std::max(st.enqueued, r.collective_seq);
        if (r.started_ns != 0) st.started = std::max(st.started, r.collective_seq);
        if (r.finished_ns != 0) st.finished = std::max(st.finished, r.collective_seq);
      }
      out.records.push_back(std::move(r));
      break;
    }
  }
  return out;
}

}  // namespace ddpx::comm::detail
