#pragma once
// A TCPStore for a job launched by mpirun (no MASTER_ADDR): rank 0 serves it
// on a free port and announces host:port over MPI. Collective over the world.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

namespace ddpx::comm::detail {

c10::intrusive_ptr<c10d::Store> store_over_mpi(int rank, int size,
                                               std::chrono::milliseconds timeout);

}  // namespace ddpx::comm::detail
