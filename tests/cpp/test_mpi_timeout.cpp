// A stalled peer must not hang the job: rank 1 stops answering (sleeps far
// past the timeout, as a SIGSTOPped or frozen rank would); rank 0's wait()
// throws DistBackendError within DDPX_TIMEOUT_S (plus a second asking the
// peers, which names the silent ones), and at exit ddpx_mpi aborts
// the MPI job instead of hanging in MPI_Finalize, which also ends rank 1.
// ctest checks rank 0's line "timeout-ok" and the test's own time limit.
#include <ddpx/comm.h>

#include <chrono>
#include <cstdio>

#include "stall_test_util.h"

int main() {
  auto pg = ddpx::comm::make_mpi_backend({}, std::chrono::milliseconds(1500));
  ddpx::test::stall_all_but_rank0(pg);
  std::vector<at::Tensor> t{at::ones({16})};
  const auto t0 = std::chrono::steady_clock::now();
  try {
    pg->allreduce(t)->wait();
    std::printf("timeout-FAILED: the collective completed\n");
    return 1;
  } catch (const c10::DistBackendError& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // The silent peers are named: rank 1 (and 2 with three ranks).
    const std::string msg = e.what();
    const bool named = msg.find("timed out") != std::string::npos &&
                       msg.find(pg->getSize() == 2 ? "rank 1 of this group did not answer"
                                                   : "ranks 1 and 2 of this group did not answer") !=
                           std::string::npos;
    std::printf("%s after %.1f s: %s\n", named && s < 10 ? "timeout-ok" : "timeout-FAILED", s,
                e.what());
    std::fflush(stdout);
    return 2;  // a failed job exits non-zero; ddpx_mpi aborts at exit
  }
}
