// ddpx_mpi: construction, posting, and the reduction-family collectives.
// Gather-family collectives are in mpi_backend_gather.cpp, point-to-point in
// mpi_backend_p2p.cpp.
#include "plugin/comm/mpi_backend.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <future>
#include <map>
#include <mutex>
#include <numeric>

#include "plugin/comm/flight_recorder.h"
#include "plugin/comm/mpi_completion.h"
#include "plugin/comm/mpi_diagnose.h"
#include "plugin/comm/mpi_env.h"
#include "plugin/comm/mpi_monitored_barrier.h"
#include "plugin/comm/mpi_types.h"
#include "plugin/comm/mpi_util.h"

namespace ddpx::comm::detail {
namespace {

int comm_rank(MPI_Comm comm) {
  int r = 0;
  DDPX_MPI_CHECK(MPI_Comm_rank(comm, &r));
  return r;
}

int comm_size(MPI_Comm comm) {
  int s = 0;
  DDPX_MPI_CHECK(MPI_Comm_size(comm, &s));
  return s;
}

// "ddpx_mpi:ALLREDUCE" and so on: the range name torch.profiler shows. The
// RecordFunction keeps the pointer, so the strings live in a node-stable map.
const char* profiling_title(c10d::OpType type) {
  static std::mutex mu;
  static std::map<c10d::OpType, std::string> titles;
  std::lock_guard<std::mutex> lock(mu);
  auto it = titles.find(type);
  if (it == titles.end()) {
    it = titles.emplace(type, "ddpx_mpi:" + c10d::opTypeToString(type)).first;
  }
  return it->second.c_str();
}

}  // namespace

c10::intrusive_ptr<MpiBackend> MpiBackend::create(const std::vector<int>& world_ranks,
                                                  std::chrono::milliseconds timeout) {
  MpiEnv& env = MpiEnv::get();
  for (int r : world_ranks) check_rank(r, env.world_size(), "global_ranks_in_group entry");
  auto worker = worker_for_new_backend();
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm diag = MPI_COMM_NULL;
  worker->run_sync([&] {
    std::vector<int> identity(env.world_size());
    std::iota(identity.begin(), identity.end(), 0);
    if (world_ranks.empty() || world_ranks == identity) {
      DDPX_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    } else {
      // Collective over the members only: torch creates a backend on members.
      MPI_Group world_group = MPI_GROUP_NULL;
      MPI_Group group = MPI_GROUP_NULL;
      DDPX_MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
      DDPX_MPI_CHECK(MPI_Group_incl(world_group, static_cast<int>(world_ranks.size()),
                                    world_ranks.data(), &group));
      DDPX_MPI_CHECK(MPI_Comm_create_group(MPI_COMM_WORLD, group, /*tag=*/0, &comm));
      MPI_Group_free(&group);
      MPI_Group_free(&world_group);
      TORCH_CHECK(comm != MPI_COMM_NULL, "ddpx_mpi: rank ", env.world_rank(),
                  " is not a member of the requested group");
    }
    DDPX_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    DDPX_MPI_CHECK(MPI_Comm_dup(comm, &diag));
    DDPX_MPI_CHECK(MPI_Comm_set_errhandler(diag, MPI_ERRORS_RETURN));
  });
  return c10::make_intrusive<MpiBackend>(comm, std::move(worker), timeout, diag);
}

MpiBackend::MpiBackend(MPI_Comm comm, std::shared_ptr<MpiWorker> worker,
                       std::chrono::milliseconds timeout, MPI_Comm diag)
    : c10d::Backend(comm_rank(comm), comm_size(comm)),
      comm_(comm),
      diag_(std::make_shared<DiagComm>(diag)),
      worker_(std::move(worker)),
      timeout_(timeout) {
  for (int r : ranks_in_parent(comm, MPI_COMM_WORLD)) world_ranks_.push_back(r);
  void* ub = nullptr;
  int flag = 0;
  if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag) == MPI_SUCCESS && flag) {
    tag_ub_ = *static_cast<int*>(ub);
  }
}

MpiBackend::~MpiBackend() { shutdown(); }

void MpiBackend::shutdown() {
  if (closed_.exchange(true)) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && !MpiEnv::get().broken()) {  // broken: a stuck peer, leave the comms alone
    // Behind every collective already posted (the worker runs in order):
    // they still run with the communicator they were posted on, as the
    // peers expect, and then it is freed. Bounded: a collective a peer
    // never joins fails at its deadline (the watchdog) and breaks MPI.
    try {
      run_in_order([this] {
        MPI_Comm_free(&comm_);
        diag_->replace(MPI_COMM_NULL);
      });
    } catch (const std::exception&) {
      // The worker is already stopped (process exit): MPI_Finalize frees them.
    }
  } else if (!finalized) {
    // The calls posted before still use this object (its communicator, rank
    // and size) when they run, and the worker may outlive it (the shared
    // worker, or one held by a post waiting for its turn). Broken, they fail
    // at once (await_request): let them, within a bound (a call stuck inside
    // MPI for good never runs them).
    try {
      drain_posted(std::chrono::seconds(5));
    } catch (...) {
      // (a destructor: nothing escapes; the calls then run as they may)
    }
  }
  // Their completions (Future callbacks) run before the interpreter can
  // finalise (mpi_work.h, quiesce).
  CompletionQueue::get().drain(timeout_);
}

void MpiBackend::abort() {
  MpiEnv::get().mark_broken("abort() was called on a ddpx_mpi backend");
  MPI_Abort(comm_ == MPI_COMM_NULL ? MPI_COMM_WORLD : comm_, 1);
}

c10::intrusive_ptr<c10d::Backend::Options> MpiBackend::getBackendOptions() {
  return c10::make_intrusive<Options>("ddpx_mpi", timeout_);
}

int MpiBackend::fr_group() {
  // Once torch has named the group the index is final: no lock per call.
  if (fr_named_.load(std::memory_order_acquire)) return fr_group_;
  std::lock_guard<std::mutex> lock(fr_mu_);
  // torch names its groups after making the backend (setGroupUid); a group
  // made in C++ may have no name: then the backend's, the same on every rank.
  const std::string uid = getGroupUid();
  std::string name = uid;
  if (name.empty()) {
    name = "ddpx_mpi";
    if (world_ranks_.size() != static_cast<size_t>(MpiEnv::get().world_size())) {
      name += ":" + c10::Join(",", world_ranks_);
    }
  }
  if (fr_group_ < 0 || name != fr_name_) {
    const std::string desc = getGroupDesc().empty() ? "undefined" : getGroupDesc();
    fr_group_ = FlightRecorder::get().group({name, desc, world_ranks_, "ddpx_mpi"});
    fr_name_ = name;
  }
  if (!uid.empty()) fr_named_.store(true, std::memory_order_release);
  return fr_group_;
}

std::chrono::milliseconds MpiBackend::diagnosis_grace() const {
  // Peers that also timed out answer within about the same time; give them
  // half the timeout, between 1 and 10 s.
  return std::clamp(timeout_ / 2, std::chrono::milliseconds(1000),
                    std::chrono::milliseconds(10000));
}

std::future<void> MpiBackend::post_in_order(std::function<void()> fn) {
  // Shared: a caller that waits with a bound may be gone when it runs.
  auto done = std::make_shared<std::promise<void>>();
  auto fut = done->get_future();
  order_->post(
      nullptr,
      [done, fn = std::move(fn), worker = worker_](uint64_t) {
        try {
          worker->enqueue({}, [done, fn](MpiWorker::Progress&) {
            try {
              fn();
              done->set_value();
            } catch (...) {
              done->set_exception(std::current_exception());
            }
          });
        } catch (...) {
          done->set_exception(std::current_exception());  // the worker is stopped
        }
      },
      nullptr);
  return fut;
}

void MpiBackend::run_in_order(const std::function<void()>& fn) { post_in_order(fn).get(); }

bool MpiBackend::drain_posted(std::chrono::milliseconds limit) {
  return post_in_order([] {}).wait_for(limit) == std::future_status::ready;
}

std::string MpiBackend::what(c10d::OpType type, uint64_t seq) const {
  return c10d::opTypeToString(type) + " #" + std::to_string(seq) + " (rank " +
         std::to_string(rank_) + " of " + std::to_string(size_) + ")";
}

c10::intrusive_ptr<MpiWork> MpiBackend::post(c10d::OpType type,
                                             const std::vector<at::Tensor>& outputs,
                                             const std::vector<at::Tensor>& inputs,
                                             std::function<void(MpiWorker::Progress&)> task,
                                             std::optional<std::chrono::milliseconds> timeout,
                                             int peer) {
  TORCH_CHECK(!closed_.load(), "ddpx_mpi: the backend was shut down");
  // Posted from a Future callback, which will likely wait for it next.
  CompletionQueue::note_blocking();
  TORCH_CHECK(!MpiEnv::get().broken(),
              "ddpx_mpi: an earlier call timed out or failed; the MPI job cannot continue: ",
              MpiEnv::get().broken_why());
  const uint64_t seq = seq_++;
  auto work = c10::make_intrusive<MpiWork>(rank_, type, what(type, seq), outputs,
                                           timeout.value_or(timeout_), profiling_title(type),
                                           std::optional<std::vector<at::Tensor>>(inputs));
  if (timing_) work->enable_timing();  // before the worker can start it
  // Device tensors are staged on the worker under the caller's current stream
  // so the copies are ordered after whatever produced the data.
  std::optional<c10::Stream> stream;
  const at::Tensor* first =
      !inputs.empty() ? &inputs[0] : (!outputs.empty() ? &outputs[0] : nullptr);
  if (first && first->defined() && !first->is_cpu()) {
    c10::impl::VirtualGuardImpl impl(first->device().type());
    stream = impl.getStream(first->device());
  }
  work->set_stream(stream);
  MpiWorker::Task on_worker = [stream, task = std::move(task)](MpiWorker::Progress& p) {
    c10::OptionalStreamGuard guard(stream);
    task(p);
  };
  const bool p2p = type == c10d::OpType::SEND || type == c10d::OpType::RECV ||
                   type == c10d::OpType::RECVANYSOURCE;
  FlightRecorder& fr = FlightRecorder::get();
  if (fr.enabled()) {
    // Recorded now; a collective is numbered when it reaches the worker.
    FlightRecorder::Call call;
    call.group = fr_group();
    call.op = fr_op(type);
    call.p2p = p2p;
    call.peer = peer;
    call.seq = p2p ? ++p2p_seq_ : 0;
    call.timeout_ms = work->timeout().count();
    call.inputs = &inputs;
    call.outputs = &outputs;
    work->set_record(fr.record(call));
  }
  if (p2p) {
    work->set_diagnosis([diag = diag_, gen = diag_->generation(), rank = rank_, size = size_,
                         grace = diagnosis_grace()] {
      return diag->describe(gen, rank, size, kPointToPoint, grace);
    });
    worker_->enqueue(work, std::move(on_worker));
  } else {
    ++collective_seq_;
    work->set_order(order_);
    // `n`: its position in the order collectives reach MPI, which is what
    // the ranks compare after a timeout.
    order_->post(
        work.get(),
        [work, on_worker, worker = worker_, diag = diag_, gen = diag_->generation(), rank = rank_,
         size = size_, grace = diagnosis_grace()](uint64_t n) {
          work->set_diagnosis([=] { return diag->describe(gen, rank, size, n, grace); });
          // Numbered in the order MPI sees: the same on every rank.
          FlightRecorder::get().set_seq(work->record(), n + 1);
          try {
            worker->enqueue(work, on_worker);
          } catch (...) {
            // The backend is shut down. Not here: completing may take the
            // order's lock, which this thread holds.
            CompletionQueue::get().push(
                [work, e = std::current_exception()] { work->complete(e); });
          }
        },
        work->issued_by());
  }
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

c10::intrusive_ptr<c10d::Work> MpiBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceOptions& opts) {
  // As Gloo: a sparse COO tensor takes the sparse path (c10d sends it here).
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() == at::kSparse) {
    return allreduce_sparse(tensors, opts);
  }
  check_single(tensors, "tensors");
  const at::Tensor t = tensors[0];
  const int count = to_count(t.numel(), "tensors[0]");
  MPI_Datatype dt = mpi_datatype(t.scalar_type(), "tensors[0]");
  MPI_Op op = mpi_op(opts.reduceOp, t.scalar_type());
  const bool avg = is_avg(opts.reduceOp);
  const int64_t op_id = static_cast<int64_t>(opts.reduceOp.op_);
  return post(c10d::OpType::ALLREDUCE, tensors, tensors, [=, this](MpiWorker::Progress&) {
    HostView h(t, /*copy_in=*/true);
    check_agreement(comm_, {1, dtype_id(t), count, op_id}, "allreduce", describe(t));
    if (count == 0) return;
    MPI_Request req = MPI_REQUEST_NULL;
    DDPX_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, h.ptr(), count, dt, op, comm_, &req));
    await_request(req, {h.host()});
    if (avg) h.host().div_(size_);
    h.write_back();
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "ddpx_mpi: allreduce_coalesced needs at least one tensor");
  int64_t total = 0;
  for (const auto& t : tensors) {
    check_same_dtype_numel(t, t, "tensors[i]");
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type() && t.device() == tensors[0].device(),
                "ddpx_mpi: allreduce_coalesced needs tensors of one dtype and device, got ",
                t.scalar_type(), " on ", t.device(), " and ", tensors[0].scalar_type(), " on ",
                tensors[0].device());
    total += t.numel();
  }
  const int count = to_count(total, "the coalesced tensors");
  MPI_Datatype dt = mpi_datatype(tensors[0].scalar_type(), "tensors");
  MPI_Op op = mpi_op(opts.reduceOp, tensors[0].scalar_type());
  const bool avg = is_avg(opts.reduceOp);
  const int64_t op_id = static_cast<int64_t>(opts.reduceOp.op_);
  const int64_t n_tensors = static_cast<int64_t>(tensors.size());
  const int64_t dtype = dtype_id(tensors[0]);
  return post(c10d::OpType::ALLREDUCE_COALESCED, tensors, tensors, [=, this](MpiWorker::Progress&) {
    std::vector<at::Tensor> flat_parts;
    flat_parts.reserve(tensors.size());
    for (const auto& t : tensors) flat_parts.push_back(t.reshape(-1).cpu());
    at::Tensor flat = at::cat(flat_parts);
    check_agreement(comm_, {2, dtype, count, op_id, n_tensors}, "allreduce_coalesced",
                    std::to_string(count) + " elements");
    if (count == 0) return;
    MPI_Request req = MPI_REQUEST_NULL;
    DDPX_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, flat.data_ptr(), count, dt, op, comm_, &req));
    await_request(req, {flat});
    if (avg) flat.div_(size_);
    int64_t offset = 0;
    for (const auto& t : tensors) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                     const c10d::BroadcastOptions& opts) {
  check_single(tensors, "tensors");
  check_rank(opts.rootRank, size_, "rootRank");
  const at::Tensor t = tensors[0];
  const int count = to_count(t.numel(), "tensors[0]");
  MPI_Datatype dt = mpi_datatype(t.scalar_type(), "tensors[0]");
  const int root = static_cast<int>(opts.rootRank);
  return post(c10d::OpType::BROADCAST, tensors, tensors, [=, this](MpiWorker::Progress&) {
    const bool is_root = rank_ == root;
    HostView h(t, /*copy_in=*/is_root);
    check_agreement(comm_, {3, dtype_id(t), count, root}, "broadcast", describe(t));
    if (count == 0) return;
    MPI_Request req = MPI_REQUEST_NULL;
    DDPX_MPI_CHECK(MPI_Ibcast(h.ptr(), count, dt, root, comm_, &req));
    await_request(req, {h.host()});
    if (!is_root) h.write_back();
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::reduce(std::vector<at::Tensor>& tensors,
                                                  const c10d::ReduceOptions& opts) {
  check_single(tensors, "tensors");
  check_rank(opts.rootRank, size_, "rootRank");
  const at::Tensor t = tensors[0];
  const int count = to_count(t.numel(), "tensors[0]");
  MPI_Datatype dt = mpi_datatype(t.scalar_type(), "tensors[0]");
  MPI_Op op = mpi_op(opts.reduceOp, t.scalar_type());
  const bool avg = is_avg(opts.reduceOp);
  const int root = static_cast<int>(opts.rootRank);
  const int64_t op_id = static_cast<int64_t>(opts.reduceOp.op_);
  return post(c10d::OpType::REDUCE, tensors, tensors, [=, this](MpiWorker::Progress&) {
    const bool is_root = rank_ == root;
    HostView h(t, /*copy_in=*/true);
    check_agreement(comm_, {4, dtype_id(t), count, op_id, root}, "reduce", describe(t));
    if (count == 0) return;
    MPI_Request req = MPI_REQUEST_NULL;
    DDPX_MPI_CHECK(MPI_Ireduce(is_root ? MPI_IN_PLACE : h.ptr(), is_root ? h.ptr() : nullptr, count,
                               dt, op, root, comm_, &req));
    await_request(req, {h.host()});
    if (is_root) {
      if (avg) h.host().div_(size_);
      h.write_back();
    }
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  check_dense(output, "output");
  check_dense(input, "input");
  TORCH_CHECK(input.scalar_type() == output.scalar_type(), "ddpx_mpi: input has dtype ",
              input.scalar_type(), " but output has ", output.scalar_type());
  TORCH_CHECK(input.numel() == output.numel() * size_, "ddpx_mpi: input must have group size (",
              size_, ") x output elements = ", output.numel() * size_, ", got ", input.numel());
  const int count = to_count(output.numel(), "output");
  to_count(input.numel(), "input");
  MPI_Datatype dt = mpi_datatype(output.scalar_type(), "output");
  MPI_Op op = mpi_op(opts.reduceOp, output.scalar_type());
  const bool avg = is_avg(opts.reduceOp);
  const int64_t op_id = static_cast<int64_t>(opts.reduceOp.op_);
  at::Tensor out = output;
  at::Tensor in = input;
  return post(c10d::OpType::_REDUCE_SCATTER_BASE, {out}, {in}, [=, this](MpiWorker::Progress&) {
    HostView hin(in, /*copy_in=*/true);
    HostView hout(out, /*copy_in=*/false);
    check_agreement(comm_, {5, dtype_id(out), count, op_id}, "reduce_scatter", describe(out));
    if (count == 0) return;
    MPI_Request req = MPI_REQUEST_NULL;
    DDPX_MPI_CHECK(MPI_Ireduce_scatter_block(hin.ptr(), hout.ptr(), count, dt, op, comm_, &req));
    await_request(req, {hin.host(), hout.host()});
    if (avg) hout.host().div_(size_);
    hout.write_back();
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  check_single(outputs, "outputTensors");
  TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
              "ddpx_mpi: inputTensors must be one list of group size (", size_, ") tensors");
  for (const auto& t : inputs[0]) check_same_dtype_numel(t, outputs[0], "inputTensors[0][i]");
  // One flat input, then the _base path: the same wire traffic as MPI would do.
  std::vector<at::Tensor> parts;
  for (const auto& t : inputs[0]) parts.push_back(t.reshape(-1));
  at::Tensor flat = at::cat(parts);
  return _reduce_scatter_base(outputs[0], flat, opts);
}

void MpiBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  TORCH_CHECK(!closed_.load(), "ddpx_mpi: the backend was shut down");
  const auto limit = opts.timeout == c10d::kUnsetTimeout ? timeout_ : opts.timeout;
  // On the worker: after the collectives posted before it, as a barrier is.
  run_in_order([&] { monitored_barrier(diag_->get(), rank_, size_, limit, wait_all_ranks); });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::barrier(const c10d::BarrierOptions&) {
  return post(c10d::OpType::BARRIER, {}, {}, [this](MpiWorker::Progress&) {
    MPI_Request req = MPI_REQUEST_NULL;
    DDPX_MPI_CHECK(MPI_Ibarrier(comm_, &req));
    await_request(req, {});
  });
}

}  // namespace ddpx::comm::detail
