#include "plugin/comm/mpi_diagnose.h"

#include "plugin/comm/peer_report.h"

#include <thread>
#include <vector>

namespace ddpx::comm::detail {

namespace {
constexpr int kAliveTag = 1;  // the roll call; mpi_monitored_barrier.cpp uses 2 and 3
}  // namespace

std::string DiagComm::describe(uint64_t generation, int rank, int size, uint64_t seq,
                               std::chrono::milliseconds grace) {
  std::lock_guard<std::mutex> lock(mu_);
  if (generation != generation_.load()) return "";
  return describe_peers(comm_, rank, size, seq, grace);
}

void DiagComm::replace(MPI_Comm next) {
  std::lock_guard<std::mutex> lock(mu_);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  comm_ = next;
  generation_.fetch_add(1);
}

MPI_Comm DiagComm::get() {
  std::lock_guard<std::mutex> lock(mu_);
  return comm_;
}

std::string describe_peers(MPI_Comm diag, int rank, int size, uint64_t seq,
                           std::chrono::milliseconds grace) {
  if (diag == MPI_COMM_NULL || size < 2) return "";
  // Leaked on purpose: requests to silent peers stay posted (the job is about
  // to end), so the buffers they point at must outlive this call.
  auto& mine = *new uint64_t(seq);
  auto& theirs = *new std::vector<uint64_t>(size, 0);
  std::vector<MPI_Request> recv(size, MPI_REQUEST_NULL);
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    MPI_Request s = MPI_REQUEST_NULL;
    if (MPI_Isend(&mine, 1, MPI_UINT64_T, r, kAliveTag, diag, &s) == MPI_SUCCESS) {
      MPI_Request_free(&s);  // small, eager: never waited on
    }
    MPI_Irecv(&theirs[r], 1, MPI_UINT64_T, r, kAliveTag, diag, &recv[r]);
  }
  std::vector<char> answered(size, 0);
  answered[rank] = 1;
  const auto deadline = std::chrono::steady_clock::now() + grace;
  int missing = size - 1;
  while (missing > 0 && std::chrono::steady_clock::now() < deadline) {
    for (int r = 0; r < size; ++r) {
      if (answered[r] || recv[r] == MPI_REQUEST_NULL) continue;
      int flag = 0;
      if (MPI_Test(&recv[r], &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) {
        answered[r] = 1;
        --missing;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::vector<int> silent, elsewhere;
  for (int r = 0; r < size; ++r) {
    if (!answered[r]) {
      silent.push_back(r);
    } else if (r != rank && seq != kPointToPoint && theirs[r] != kPointToPoint &&
               theirs[r] != seq) {
      elsewhere.push_back(r);
    }
  }
  return peer_report(silent, elsewhere, grace, "stopped, dead, or not in any ddpx_mpi call",
                     "waited in a different collective (the ranks did not make the same calls)");
}

}  // namespace ddpx::comm::detail
