#pragma once
// monitored_barrier for ddpx_mpi, with Gloo's contract (c10d's
// monitoredBarrier): rank 0 waits for every other rank's arrival for at most
// `timeout`, names the first rank that did not arrive ("Rank 1 failed to pass
// monitoredBarrier in 2000 ms"), or all of them with `wait_all`, and only
// then releases the others; a rank that arrived but is not released reports
// that ("Rank 2 successfully reached monitoredBarrier, but received errors
// while waiting for send/recv from rank 0"). A timeout of 0 is this rank's
// own ("Rank 0 timed out in monitoredBarrier after 0 ms").
//
// Messages go on `diag`, the backend's diagnostic communicator (tags apart
// from the timeout roll call's), so they never meet user sends. A failed
// monitored barrier does not break MPI (it is a probe, as under Gloo):
// outstanding receives are cancelled and the group stays usable.
#include <mpi.h>

#include <chrono>

namespace ddpx::comm::detail {

// Collective over `diag`; throws c10::DistBackendError as described above.
void monitored_barrier(MPI_Comm diag, int rank, int size, std::chrono::milliseconds timeout,
                       bool wait_all);

}  // namespace ddpx::comm::detail
