#pragma once
// The deadline of every ddpx_mpi Work, whoever waits for it.
//
// Work::wait(timeout) bounds a wait on the Work, but a caller may wait on its
// Future instead (Future::wait has no timeout; PyTorch's comm hooks and
// functional collectives do), or on a Future chained to it, or not wait at
// all. So a Work is armed here when the worker starts it; a Work not
// complete `timeout` later fails with the same error Work::wait gives
// (DistBackendError naming the collective and, once per process, the silent
// peers), which also completes its Future with that error. MPI is then
// marked broken, the worker abandons the call, and the job aborts at exit.
#include <c10/util/intrusive_ptr.h>

#include <chrono>

namespace ddpx::comm::detail {

class MpiWork;

// Arms `work`'s deadline, `timeout` from now. Thread-safe; cheap (the
// watchdog thread drops completed Works when it wakes).
void watch(const c10::intrusive_ptr<MpiWork>& work, std::chrono::milliseconds timeout);

}  // namespace ddpx::comm::detail
