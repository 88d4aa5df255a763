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
//
// Ownership: the watchdog holds no reference to an armed Work. A Work is
// disarmed by MpiWork::complete, which runs while the worker still holds it,
// so an armed Work is alive. Holding references (even weak ones, which keep
// an intrusive_ptr's memory) would make this thread the one that destroys
// finished Works and their tensors: a tensor whose Python object outlived its
// last Python reference needs the GIL to be freed, and a thread that asks a
// finalising interpreter for the GIL is ended by pthread_exit, whose unwind
// through a noexcept destructor is std::terminate at process exit.
#include <chrono>

namespace ddpx::comm::detail {

class MpiWork;

// Arms `work`'s deadline, `timeout` from now (no deadline if <= 0).
// Thread-safe; the caller must hold a reference to `work` until it disarms.
void watch(MpiWork* work, std::chrono::milliseconds timeout);

// Disarms `work` (no-op if it is not armed). After it returns the watchdog
// will not touch `work` again, except through a reference it took before.
void unwatch(MpiWork* work);

}  // namespace ddpx::comm::detail
