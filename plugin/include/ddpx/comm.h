#pragma once
// ddpx's communication layer: process groups for C++ trainers.
//
// (tests/cpp/test_header_examples.cpp runs this text as it stands and checks
// the sums):
// [example comm]
//   auto pg = ddpx::comm::init_from_env();   // mpirun -> ddpx_mpi,
//                                            // torchrun -> Gloo (+NCCL for CUDA)
//   auto gloo = ddpx::comm::make("gloo");    // an explicit choice; every rank calls it
//   std::vector<at::Tensor> t{at::ones({4})};
//   gloo->allreduce(t)->wait();              // t[0]: the world size, everywhere
//   if (pg->getRank() < 2) {                 // only the members call it
//     auto pair = ddpx::comm::make_mpi_backend({0, 1});  // ddpx_mpi over world ranks 0, 1
//     pair->allreduce(t)->wait();            // t[0]: twice the world size on ranks 0, 1
//   }
// [end example]
//
// Timeouts: every collective's Work::wait() throws c10::DistBackendError after
// the group's timeout; the default is DDPX_TIMEOUT_S seconds when that is set,
// else 30 minutes (torch's default).
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace ddpx::comm {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using BackendPtr = c10::intrusive_ptr<c10d::Backend>;

std::chrono::milliseconds default_timeout();

// How this process was launched.
enum class Launcher { Mpi, Torchrun, None };
Launcher detect_launcher();

struct MakeOptions {
  std::chrono::milliseconds timeout = default_timeout();
  // Rendezvous for Gloo/NCCL. Unset: torchrun's MASTER_ADDR/MASTER_PORT, or,
  // under mpirun, a TCPStore that rank 0 serves and announces over MPI.
  c10::intrusive_ptr<c10d::Store> store;
  int rank = -1;  // -1: from the launcher
  int size = -1;
  // A prefix that keeps several groups on one store apart.
  std::string name = "default";
};

// A process group from the launcher's environment: ddpx_mpi under mpirun
// (rank and size from MPI), Gloo for CPU plus NCCL for CUDA (when built and a
// GPU is present) under torchrun, and a one-rank Gloo group otherwise.
ProcessGroupPtr init_from_env(std::chrono::milliseconds timeout = default_timeout());

// A process group with the named backend: "ddpx_mpi", "gloo" or "nccl", or a
// per-device list "cpu:gloo,cuda:nccl". Collective: every rank must call it.
ProcessGroupPtr make(const std::string& backend, const MakeOptions& opts = {});

// The ddpx_mpi backend over `world_ranks` (MPI_COMM_WORLD ranks, empty = all).
// Collective over the members.
BackendPtr make_mpi_backend(const std::vector<int>& world_ranks = {},
                            std::chrono::milliseconds timeout = default_timeout());

// "rank R of N on HOST" from the launcher's environment (no collective), for
// error messages.
std::string process_label();

// Ends this process with `code` after an unrecoverable error. Under mpirun the
// whole job is aborted (MPI_Abort), so peers blocked in a collective with this
// rank end now instead of at their timeout; otherwise the process exits
// without running static destructors (a comm thread may be stuck).
[[noreturn]] void abort_job(int code);

// Names the ranks behind a failed or timed-out collective of `pg`, for groups
// whose ranks share a store (Gloo, NCCL: their errors do not say which peer
// stopped; ddpx_mpi asks its peers itself and says so in its error). Every
// rank that saw the failure calls it: each checks in on the store with `seq`
// (where it failed, e.g. its step) and waits up to `grace` (0: half the
// group's timeout, within 1..10 s) for the others. Returns a sentence naming
// the ranks that never checked in and those that did from another `seq`; ""
// when the store is local to this process (nothing to ask). Bounded: if the
// store stops answering too, says so after grace + 2 s.
std::string roll_call(c10d::ProcessGroup& pg, int64_t seq,
                      std::chrono::milliseconds grace = std::chrono::milliseconds(0));

// ---- Losing ranks under mpirun (ddpx-train --on-rank-loss shrink) ----------
// Open MPI 4 keeps the other ranks running when one dies only under
// `mpirun --mca orte_enable_recovery 1` (ddpx-run passes it); this says
// whether this job runs so.
bool mpi_recovery_mode();

// After a collective failed because ranks died or froze, the ranks still
// running agree on who is left, in bounded time, with point-to-point
// messages only (the lost ranks would never join a collective):
//   1. each of `members` (world ranks, this one among them) sends the others
//      its `progress` (e.g. the steps it completed) and keeps those it hears
//      from within `window`;
//   2. each sends what it heard to those it heard from, and keeps the ranks
//      that every answer names;
//   3. each sends that set; a different one, or none within `window`, is an
//      error on every rank that sees it.
// Every survivor calls it after the same failure with the same members and
// within `window` of the others (the groups' timeout is a safe window: the
// survivors all fail the collective the lost rank never joined). Throws a
// c10::Error when the others left this rank out or the survivors disagree.
struct Survivors {
  std::vector<int> world_ranks;   // ascending
  std::vector<int64_t> progress;  // each one's, in that order
  std::vector<int> lost;          // the members not among them
};
Survivors agree_on_survivors(const std::vector<int>& members, int64_t progress,
                             std::chrono::milliseconds window);

// A ddpx_mpi group of the survivors (ranked in world-rank order; collective
// over them only). The failure that led here stops failing new calls, and
// every call posted on the old groups is abandoned: call nothing more on them.
// The new group's rank 0 ends the MPI job at exit with MPI_Abort (code 0):
// MPI_Finalize would wait for the lost ranks, a frozen one for ever.
ProcessGroupPtr shrink_group(const Survivors& survivors, std::chrono::milliseconds timeout);

// A C++ trainer that goes on without a lost rank (what ddpx-train's
// --on-rank-loss shrink does, plugin/trainer/trainer.cpp): catch the step's
// c10::Error; take the GradSync's state() (grad_sync.h) and destroy it;
// agree_on_survivors(members, steps_done, timeout) and shrink_group; build a
// new GradSync over the new group and load_state the old state (buckets
// re-planned, each rank's codec residuals kept); give every survivor the
// model and optimizer of the one with the most progress (a broadcast on the
// new group); and take each step's rows with ddpx::data's
// global_batch_slice(permutation, step, global_batch, rank, size) at the new
// size, so the global batches stay the same. Nothing more may be called on
// the old group.

// ---- When a job hangs: the flight recorder (README "When a job hangs") ----
// Every process keeps its recent collectives on ddpx_mpi groups and
// GradSync's bucket reductions in a ring (PyTorch's TORCH_FR_BUFFER_SIZE
// entries, default 2000; 0: off). dump_trace writes it in PyTorch's
// flight-recorder dump format to `path` ("": <TORCH_FR_DUMP_TEMP_FILE><rank>,
// default /tmp/nccl_trace_rank_<rank>) and returns the path; PyTorch's
// analyzer (python -m torch.distributed.flight_recorder.fr_trace DIR) and
// `ddpx-trace analyze DIR` read a directory of them. A collective that
// times out or fails writes it once by itself (TORCH_FR_DUMP_ON_TIMEOUT=0:
// not). Thread-safe.
std::string dump_trace(const std::string& path = "");
// From now on signal `signo` (e.g. SIGUSR1: `kill -USR1 <pid>`) makes this
// process write dump_trace() (from a thread of its own, not the handler).
void dump_trace_on_signal(int signo);

// Names of the backends this build can make.
std::vector<std::string> available_backends();

}  // namespace ddpx::comm
