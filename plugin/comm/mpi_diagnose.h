#pragma once
// Naming the rank behind a ddpx_mpi timeout. MPI cannot tell which peer is
// missing from a collective, so the ranks whose wait timed out ask each other
// on a communicator kept for this alone.
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace ddpx::comm::detail {

// `seq` of a send or receive: not compared (ranks in step may have made
// different numbers of them).
constexpr uint64_t kPointToPoint = ~uint64_t{0};

// Called by every rank whose wait timed out (while its worker may still sit
// inside the stuck call: MPI runs at THREAD_MULTIPLE). It sends its
// collective number `seq` to every other rank of `diag` and listens for
// theirs for `grace`. Returns a sentence naming the ranks that never answered
// (stopped, dead, or not waiting at all) and those that answered from a
// different collective; when every rank answered alike, they are all alive
// and waiting: the transfer stalled, or a send has no matching receive.
std::string describe_peers(MPI_Comm diag, int rank, int size, uint64_t seq,
                           std::chrono::milliseconds grace);

// A backend's diagnosis communicator, shared with its Works' diagnoses. The
// backend frees or replaces it (shutdown, reconfigure) while a send or
// receive may still be pending, and that Work's timeout asks the peers later
// from another thread: under the lock, on the communicator the Work was
// posted with (its generation), and nobody once that one is gone.
class DiagComm {
 public:
  explicit DiagComm(MPI_Comm comm) : comm_(comm) {}
  DiagComm(const DiagComm&) = delete;
  DiagComm& operator=(const DiagComm&) = delete;
  // Which communicator it holds now (a Work notes it when posted).
  uint64_t generation() const { return generation_.load(); }
  // describe_peers on it, `rank` and `size` being the Work's in `generation`;
  // "" once that communicator is freed or replaced (or was never made).
  std::string describe(uint64_t generation, int rank, int size, uint64_t seq,
                       std::chrono::milliseconds grace);
  // Frees the communicator it holds and holds `next` (MPI_COMM_NULL: none).
  void replace(MPI_Comm next);
  // For the worker's own calls (monitored barrier), which replace() runs
  // between.
  MPI_Comm get();

 private:
  std::mutex mu_;
  MPI_Comm comm_;
  std::atomic<uint64_t> generation_{0};
};

}  // namespace ddpx::comm::detail
