#pragma once
// ddpx-train's side of the flight recorder (README "When a job hangs"):
// SIGUSR1 writes a rank's dump, and a step that fails on a collective (a
// timeout, a desync) prints one screen that says where every rank was,
// gathered from the ranks over the job's store
// (plugin/comm/flight_exchange.h).
#include <chrono>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace ddpx::trainer {

// Once the job's group exists (collective under mpirun: a store is made).
void arm_hang_report(c10d::ProcessGroup& pg, std::chrono::milliseconds timeout);

// After a collective failed: prints the screen to stderr on one rank of the
// job (the first to ask), waiting a bounded time for the others' buffers.
// Nothing if not armed, or if the recorder is off (TORCH_FR_BUFFER_SIZE=0).
void print_hang_report();

}  // namespace ddpx::trainer
