#pragma once
// The flight recorder: each process's recent collectives and point-to-point
// calls in a ring of fixed size, read back after a hang or a desync
// (issue 62). One recorder per process, as PyTorch's, shared by every
// ddpx_mpi group and every GradSync; the dump format is in flight_dump.h,
// the cross-rank analysis in flight_report.h.
//
// Protocol:
//  1. record() claims the next slot with one atomic fetch_add (its id, which
//     also numbers the record) and fills it under the slot's sequence word
//     (a seqlock: odd while written). No lock, no allocation, no collective.
//     ddpx_mpi records a call when it is posted and numbers a collective
//     (set_seq) when it reaches the worker in its group's order
//     (post_order.h), so collective_seq_id is the order MPI sees, the same
//     on every rank; GradSync records a bucket's reduction when it launches,
//     with the step, the bucket and its parameters, and each step's
//     agreement (the step alone).
//  2. set_seq(id) / started(id) / finished(id) stamp the record later, from
//     whichever thread; a slot already reused by a newer record ignores them.
//  3. snapshot() copies every written slot (retrying one being written) in
//     record order, with the groups and name lists, for a dump.
//  4. Size: TORCH_FR_BUFFER_SIZE, else TORCH_NCCL_TRACE_BUFFER_SIZE (PyTorch's
//     own settings, read as it reads them), default 2000 as PyTorch's: a few
//     hundred steps of a bucketed model, 1 MB. 0 turns recording off: record()
//     returns at its first test.
// Thread-safe.
#include <c10/core/ScalarType.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

namespace at {
class Tensor;
}

namespace ddpx::comm::detail {

// The ops a record names, as PyTorch's profiling names spell them.
enum class FrOp : uint8_t {
  kAllReduce,
  kBroadcast,
  kReduce,
  kAllGather,
  kAllGatherBase,
  kAllGatherCoalesced,
  kReduceScatter,
  kReduceScatterBase,
  kReduceScatterCoalesced,
  kGather,
  kScatter,
  kAllToAll,
  kAllToAllBase,
  kBarrier,
  kSend,
  kRecv,
  kCoalesced,
  kOther,
};
const char* fr_op_name(FrOp op);
FrOp fr_op(c10d::OpType type);

// One record, as snapshot() returns it.
struct FrRecord {
  uint64_t id = 0;
  int group = -1;  // FlightRecorder::groups() index
  FrOp op = FrOp::kOther;
  bool p2p = false;
  int peer = -1;                // p2p: the other rank (group rank); -1: any source
  uint64_t collective_seq = 0;  // 1-based, per group; 0 for p2p
  uint64_t p2p_seq = 0;         // 1-based, per group; 0 for collectives
  int64_t created_ns = 0;       // wall clock (ns since the epoch)
  int64_t started_ns = 0;       // 0: not started
  int64_t finished_ns = 0;      // 0: not finished
  bool failed = false;
  int64_t timeout_ms = 0;
  std::vector<std::vector<int64_t>> input_sizes, output_sizes;
  std::vector<c10::ScalarType> input_dtypes, output_dtypes;
  // GradSync's records: the synced step (1-based), the bucket and the
  // FlightRecorder::names() index of its parameters' names; -1 elsewhere.
  int64_t step = -1;
  int bucket = -1;
  int names = -1;
  uint64_t thread_id = 0;
  std::string thread_name;
};

struct FrGroup {
  std::string name;  // c10d's group name (PyTorch's pg_name), the same on every rank
  std::string desc;
  std::vector<int64_t> ranks;  // global ranks, in group-rank order
  std::string lib;             // who records: "ddpx_mpi" or "gradsync"
};

struct FrSnapshot {
  std::vector<FrGroup> groups;
  std::vector<std::vector<std::string>> names;
  std::vector<FrRecord> records;  // oldest first
  // Per group: the last collective_seq enqueued, started, finished.
  struct Status {
    uint64_t enqueued = 0, started = 0, finished = 0;
  };
  std::vector<Status> status;
};

class FlightRecorder {
 public:
  static constexpr int kMaxTensors = 8;  // sizes kept per record (inputs + outputs)
  static constexpr int kMaxDims = 32;    // dimensions kept per record

  // The process's recorder (never destroyed: threads may record at exit).
  static FlightRecorder& get();
  // A recorder of `capacity` slots (0: off), for tests.
  explicit FlightRecorder(size_t capacity);
  ~FlightRecorder();
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  bool enabled() const { return capacity_ > 0 && !paused_.load(std::memory_order_relaxed); }
  size_t capacity() const { return capacity_; }
  // Pauses (or resumes) recording: while paused record() returns at its
  // first test, as when off. For measuring the recorder's cost in one
  // process (scripts/bench/flight_recorder). Returns the previous state.
  bool set_paused(bool paused) { return paused_.exchange(paused); }

  // A group's index (registered on first use; the same name, desc and ranks
  // give the same index).
  int group(const FrGroup& g);
  // A name list's index (GradSync's buckets, registered when planned).
  int names(std::vector<std::string> list);

  struct Call {
    int group = -1;
    FrOp op = FrOp::kOther;
    bool p2p = false;
    int peer = -1;
    uint64_t seq = 0;        // collective_seq or p2p_seq (1-based)
    int64_t created_ns = 0;  // 0: now
    int64_t timeout_ms = 0;
    const std::vector<at::Tensor>* inputs = nullptr;
    const std::vector<at::Tensor>* outputs = nullptr;
    // Instead of tensors: one [numel] tensor of `dtype` each way.
    int64_t numel = -1;
    c10::ScalarType dtype = c10::ScalarType::Float;
    int64_t step = -1;
    int bucket = -1;
    int names = -1;
  };
  // Returns the record's id (0 when off).
  uint64_t record(const Call& call);
  // The record's sequence number, when it is known only later (ddpx_mpi
  // numbers a collective when it reaches the worker, post_order.h).
  void set_seq(uint64_t id, uint64_t seq);
  void started(uint64_t id);
  void finished(uint64_t id, bool failed = false);

  FrSnapshot snapshot() const;

  static int64_t now_ns();

 private:
  struct Slot;
  Slot* slot_of(uint64_t id) const;

  const size_t capacity_;
  std::unique_ptr<Slot[]> slots_;
  std::atomic<uint64_t> next_{1};  // ids start at 1: 0 means "not recorded"
  std::atomic<bool> paused_{false};
  mutable std::mutex registry_mu_;  // groups and names only: not on the hot path
  std::vector<FrGroup> groups_;
  std::vector<std::vector<std::string>> names_;
};

// PyTorch's settings, read as PyTorch reads them (the TORCH_FR_ name first,
// then its TORCH_NCCL_ alias).
size_t fr_buffer_size();       // TORCH_FR_BUFFER_SIZE, default 2000
bool fr_dump_on_timeout();     // TORCH_FR_DUMP_ON_TIMEOUT, default true
std::string fr_dump_prefix();  // TORCH_FR_DUMP_TEMP_FILE, default /tmp/nccl_trace_rank_

}  // namespace ddpx::comm::detail
