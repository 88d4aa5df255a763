// A backend destroyed right after a timeout, with calls still queued behind
// the one that timed out, on a worker that outlives it: MPI initialised by
// the host program at MPI_THREAD_SERIALIZED, so ddpx_mpi's backends share
// one worker thread. The queued calls read the backend (its communicator,
// rank and size) when they run, so its destruction waits for them; they
// fail at once, MPI being broken (the AddressSanitizer pass reported a
// heap-use-after-free before). ctest checks rank 0's line "destroy-ok"; the
// other ranks sleep until rank 0 aborts the job.
#include <ddpx/comm.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "stall_test_util.h"

int main() {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  auto other = ddpx::comm::make_mpi_backend({}, std::chrono::milliseconds(1500));  // holds the worker
  auto pg = ddpx::comm::make_mpi_backend({}, std::chrono::milliseconds(1500));
  ddpx::test::stall_all_but_rank0(pg);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<std::vector<at::Tensor>> tensors(20, std::vector<at::Tensor>{at::ones({1024})});
  for (auto& t : tensors) works.push_back(pg->allreduce(t));
  bool timed_out = false;
  try {
    works[0]->wait();
  } catch (const c10::DistBackendError&) {
    timed_out = true;
  }
  works.clear();
  pg.reset();  // the calls behind the first may still be queued
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::printf("%s\n", timed_out ? "destroy-ok" : "destroy-FAILED: no timeout");
  std::fflush(stdout);
  MPI_Abort(MPI_COMM_WORLD, 2);  // MPI is the host program's: it ends the job
}
