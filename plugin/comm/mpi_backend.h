#pragma once
// ddpx_mpi: a c10d::Backend over MPI for stock PyTorch wheels (which ship
// without MPI). Named ddpx_mpi, never "mpi": torch special-cases that name.
//
// Each backend owns a duplicated communicator (a sub-group gets its own from
// MPI_Comm_create_group) and posts every call to an MpiWorker (mpi_work.h);
// the protocol is written down there. Before each collective the ranks agree
// on sizes, dtypes, op and root (mpi_util.h), so a mismatch is an error on
// every rank instead of memory corruption.
//
// Semantics follow ProcessGroupGloo: one tensor per call; AVG is SUM then a
// division (floating types only); bool SUM/MAX is "any", PRODUCT/MIN "all".
// The coalesced collectives and the coalescing block are in
// mpi_backend_coalesced.cpp; split and the error state in
// mpi_backend_group.cpp.
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <vector>

#include "plugin/comm/mpi_diagnose.h"
#include "plugin/comm/mpi_work.h"

namespace ddpx::comm::detail {

class MpiBackend final : public c10d::Backend {
 public:
  // Collective over `world_ranks` (MPI_COMM_WORLD ranks, the new group's
  // ranks in their order; empty = all ranks).
  static c10::intrusive_ptr<MpiBackend> create(const std::vector<int>& world_ranks,
                                               std::chrono::milliseconds timeout);

  // diag: a duplicate of comm for naming peers after a timeout (may be null).
  MpiBackend(MPI_Comm comm, std::shared_ptr<MpiWorker> worker, std::chrono::milliseconds timeout,
             MPI_Comm diag = MPI_COMM_NULL);
  ~MpiBackend() override;

  const std::string getBackendName() const override { return "ddpx_mpi"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  void shutdown() override;
  void abort() override;
  uint64_t getSequenceNumberForGroup() override { return collective_seq_.load(); }

  // Group management (mpi_backend_group.cpp). split: every rank of this group
  // calls it (torch's split_group does); members of `ranks` (ranks of this
  // group, in their new order) get a backend on a communicator from
  // MPI_Comm_split, the others nullptr. getError: TIMEOUT or COMM_ERROR once
  // a call has failed (MPI is then broken for the whole process).
  // enableCollectivesTiming: Works posted afterwards answer getDuration().
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;
  // merge: the `size` processes that call it with one store (torch's
  // mergeRemoteGroup) become a group, ranked in the store's order; they must
  // be processes of this MPI job.
  c10::intrusive_ptr<c10d::Backend> merge(const c10::intrusive_ptr<c10d::Store>& store,
                                          const c10::intrusive_ptr<Options>& opts, const int& rank,
                                          const int& size) override;
  // reconfigure: the group rebuilt in place among the processes whose
  // handles (get_reconfigure_handle: "job:world_rank") are given, in the
  // list's order (a set: world-rank order); calls posted before it finish on
  // the old communicator. Members only: torch's fault-tolerance flow.
  // (Only where torch's Backend has it: 2.15, not 2.11.)
#ifdef C10D_BACKEND_HAS_RECONFIGURE
  bool supportsReconfigure() const override { return true; }
  c10d::ReconfigureHandle get_reconfigure_handle() const override;
  c10::intrusive_ptr<c10d::Work> reconfigure(const c10d::ReconfigureOptions& opts) override;
#endif
  c10d::ErrorType getError() override;
  void enableCollectivesTiming() override { timing_ = true; }

  // Between startCoalescing and endCoalescing every call is posted as usual
  // (the worker keeps their order); endCoalescing returns one Work that
  // completes when all of them have.
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& input_list,
      const c10d::AllgatherOptions& opts) override;
  // 2.15's names; before, allgather_into_tensor_coalesced and
  // reduce_scatter_tensor_coalesced (2.15 keeps those as aliases).
  c10::intrusive_ptr<c10d::Work> DDPX_ALL_GATHER_SINGLE_COALESCED(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> DDPX_REDUCE_SCATTER_SINGLE_COALESCED(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // A barrier whose timeout error names the ranks that did not arrive.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  // Creates the Work and queues `task` on the worker, under the caller's
  // current stream when `outputs` live on a device.
  // `timeout` overrides the group's for this Work's deadline.
  // `peer`: a send's or receive's other rank (-1: any source), for the
  // flight recorder.
  c10::intrusive_ptr<MpiWork> post(c10d::OpType type, const std::vector<at::Tensor>& outputs,
                                   const std::vector<at::Tensor>& inputs,
                                   std::function<void(MpiWorker::Progress&)> task,
                                   std::optional<std::chrono::milliseconds> timeout = std::nullopt,
                                   int peer = -1);
  // This group in the flight recorder (flight_recorder.h): by the name and
  // description torch gives it after construction, once it has.
  int fr_group();
  std::string what(c10d::OpType type, uint64_t seq) const;
  // How long a timed-out rank listens for its peers (mpi_diagnose.h).
  std::chrono::milliseconds diagnosis_grace() const;
  // Runs `fn` on the worker in this group's post order (post_order.h),
  // after every collective posted before it; waits for it.
  void run_in_order(const std::function<void()>& fn);
  // What run_in_order waits for: `fn` posted in order; its future.
  std::future<void> post_in_order(std::function<void()> fn);
  // Waits (at most `limit`) until every call posted before has left the
  // worker; false on timeout.
  bool drain_posted(std::chrono::milliseconds limit);
  c10::intrusive_ptr<MpiWork> post_recv(std::vector<at::Tensor>& tensors, int src, int tag);
  void check_tag(int tag) const;

  MPI_Comm comm_;  // freed by shutdown() on the worker, after the collectives posted before it
  std::atomic<bool> closed_{false};  // shutdown() was called: nothing more is posted
  // A duplicate used only to name peers after a timeout (mpi_diagnose.h).
  std::shared_ptr<DiagComm> diag_;
  std::shared_ptr<MpiWorker> worker_;
  // When this group's collectives reach the worker (post_order.h).
  std::shared_ptr<PostOrder> order_ = PostOrder::create();
  std::chrono::milliseconds timeout_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<uint64_t> collective_seq_{0};
  std::atomic<uint64_t> p2p_seq_{0};
  std::vector<int64_t> world_ranks_;  // MPI_COMM_WORLD ranks of the members, in rank order
  std::mutex fr_mu_;                  // the two below, until fr_named_
  std::string fr_name_;               // the group name fr_group_ was registered under
  int fr_group_ = -1;
  std::atomic<bool> fr_named_{false};  // torch named the group: fr_group_ is final
  std::atomic<bool> timing_{false};
  // The store of the last split() call (caller's thread): its repeat for
  // another device type is answered without splitting again.
  c10::intrusive_ptr<c10d::Store> last_split_store_;
  int tag_ub_ = 32767;
  // The coalescing block (caller's thread only, like the c10d calls).
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<MpiWork>> coalesced_;
};

}  // namespace ddpx::comm::detail
