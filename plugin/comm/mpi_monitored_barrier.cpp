#include "plugin/comm/mpi_monitored_barrier.h"

#include <c10/util/Exception.h>

#include <string>
#include <thread>
#include <vector>

namespace ddpx::comm::detail {
namespace {

// Tags on the diagnostic communicator; mpi_diagnose.cpp's roll call uses 1.
constexpr int kArrivedTag = 2;
constexpr int kReleaseTag = 3;

using Clock = std::chrono::steady_clock;

// Tests `reqs` until all complete or `deadline`; marks each completed one.
void wait_until(std::vector<MPI_Request>& reqs, std::vector<char>& done,
                Clock::time_point deadline) {
  for (;;) {
    bool all = true;
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (done[i]) continue;
      int flag = 0;
      MPI_Test(&reqs[i], &flag, MPI_STATUS_IGNORE);
      if (flag) {
        done[i] = 1;
      } else {
        all = false;
      }
    }
    if (all || Clock::now() >= deadline) return;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// Cancels what did not complete (a late peer's message then stays unmatched
// instead of landing in a buffer that is gone).
void cancel_rest(std::vector<MPI_Request>& reqs, const std::vector<char>& done) {
  for (size_t i = 0; i < reqs.size(); ++i) {
    if (done[i] || reqs[i] == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&reqs[i]);
    MPI_Wait(&reqs[i], MPI_STATUS_IGNORE);
  }
}

}  // namespace

void monitored_barrier(MPI_Comm diag, int rank, int size, std::chrono::milliseconds timeout,
                       bool wait_all) {
  if (size < 2) return;
  // No time to hear from anyone: this rank, not a peer, is the one that timed out.
  TORCH_CHECK_WITH(DistBackendError, timeout.count() > 0, "ddpx_mpi: Rank ", rank,
                   " timed out in monitoredBarrier after ", timeout.count(), " ms");
  const auto deadline = Clock::now() + timeout;
  if (rank != 0) {
    std::vector<MPI_Request> reqs(2, MPI_REQUEST_NULL);
    MPI_Isend(nullptr, 0, MPI_BYTE, 0, kArrivedTag, diag, &reqs[0]);
    MPI_Irecv(nullptr, 0, MPI_BYTE, 0, kReleaseTag, diag, &reqs[1]);
    std::vector<char> done(2, 0);
    wait_until(reqs, done, deadline);
    if (done[0] && done[1]) return;
    cancel_rest(reqs, done);
    C10_THROW_ERROR(DistBackendError,
                    "ddpx_mpi: Rank " + std::to_string(rank) +
                        " successfully reached monitoredBarrier, but received errors while "
                        "waiting for send/recv from rank 0 (no release within " +
                        std::to_string(timeout.count()) + " ms)");
  }
  std::vector<MPI_Request> arrived(size - 1, MPI_REQUEST_NULL);
  for (int r = 1; r < size; ++r) {
    MPI_Irecv(nullptr, 0, MPI_BYTE, r, kArrivedTag, diag, &arrived[r - 1]);
  }
  std::vector<char> done(size - 1, 0);
  wait_until(arrived, done, deadline);
  std::vector<int> missing;
  for (int r = 1; r < size; ++r) {
    if (!done[r - 1]) missing.push_back(r);
  }
  if (!missing.empty()) {
    cancel_rest(arrived, done);
    std::string who;
    if (wait_all) {
      for (size_t i = 0; i < missing.size(); ++i) {
        who += (i ? ", " : "") + std::to_string(missing[i]);
      }
      who = (missing.size() == 1 ? "Rank " : "Ranks ") + who;
    } else {
      who = "Rank " + std::to_string(missing[0]);
    }
    C10_THROW_ERROR(DistBackendError, "ddpx_mpi: " + who + " failed to pass monitoredBarrier in " +
                                          std::to_string(timeout.count()) + " ms");
  }
  std::vector<MPI_Request> release(size - 1, MPI_REQUEST_NULL);
  for (int r = 1; r < size; ++r) {
    MPI_Isend(nullptr, 0, MPI_BYTE, r, kReleaseTag, diag, &release[r - 1]);
  }
  MPI_Waitall(size - 1, release.data(), MPI_STATUSES_IGNORE);  // zero bytes: eager
}

}  // namespace ddpx::comm::detail
