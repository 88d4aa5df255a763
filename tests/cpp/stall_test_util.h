#pragma once
// The start of the stalled-rank tests (ddpx_add_stall_test in CMakeLists.txt).
#include <ddpx/comm.h>

#include <chrono>
#include <cstdlib>
#include <thread>
#include <vector>

namespace ddpx::test {

// Every rank makes one collective of `pg` (all are alive here); then every
// rank but 0 stops answering: it sleeps far past the test's limit, as a
// SIGSTOPped or frozen rank would, until rank 0's end aborts the job.
// Returns on rank 0 only.
inline void stall_all_but_rank0(const ddpx::comm::BackendPtr& pg) {
  std::vector<at::Tensor> t{at::ones({16})};
  pg->allreduce(t)->wait();
  if (pg->getRank() != 0) {
    std::this_thread::sleep_for(std::chrono::seconds(120));
    std::exit(0);
  }
}

}  // namespace ddpx::test
