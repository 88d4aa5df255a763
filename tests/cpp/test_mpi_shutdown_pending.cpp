// A receive still pending when its backend shuts down (which frees the
// group's communicators), then waited on past its deadline: the timeout
// reports it without asking the peers on the freed diagnosis communicator
// (it used to hand MPI the freed handle). ctest checks rank 0's line
// "pending-ok"; the other ranks sleep until ddpx_mpi aborts the job at exit.
#include <ddpx/comm.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "stall_test_util.h"

int main() {
  auto pg = ddpx::comm::make_mpi_backend({}, std::chrono::milliseconds(1500));
  ddpx::test::stall_all_but_rank0(pg);
  std::vector<at::Tensor> t{at::ones({16})};
  auto work = pg->recv(t, 1, 5);  // rank 1 sends nothing
  pg->shutdown();
  try {
    work->wait();
    std::printf("pending-FAILED: the receive completed\n");
    return 1;
  } catch (const c10::DistBackendError& e) {
    const std::string msg = e.what();
    const bool ok = msg.find("timed out") != std::string::npos &&
                    msg.find("did not answer") == std::string::npos;  // nobody was asked
    std::printf("%s: %s\n", ok ? "pending-ok" : "pending-FAILED", e.what());
    std::fflush(stdout);
    return 2;  // a failed job exits non-zero; ddpx_mpi aborts at exit
  }
}
