#include "plugin/comm/mpi_watchdog.h"

#include "plugin/comm/deadline_thread.h"
#include "plugin/comm/mpi_work.h"

namespace ddpx::comm::detail {
namespace {

DeadlineThread& dog() {
  // Never destroyed: Works may be armed until the process ends.
  static auto* thread = new DeadlineThread(
      "ddpx_mpi_dog", [](void* key, std::chrono::milliseconds timeout) -> std::function<void()> {
        auto* work = static_cast<MpiWork*>(key);
        // Armed, so alive (see the header): a reference keeps it so while it
        // fails unlocked. (A count of 0 is a Work being destroyed without
        // completing, by a worker abandoned at exit; its destructor waits for
        // the lock to disarm it.)
        if (c10::raw::intrusive_ptr::use_count(work) == 0) return {};
        // Failing a Work may ask the peers for up to a few seconds: unlocked,
        // so the worker can keep arming Works meanwhile.
        return [ref = c10::intrusive_ptr<MpiWork>::reclaim_copy(work), timeout] {
          ref->time_out(timeout);
        };
      });
  return *thread;
}

}  // namespace

void watch(MpiWork* work, std::chrono::milliseconds timeout) { dog().arm(work, timeout); }

void unwatch(MpiWork* work) { dog().disarm(work); }

}  // namespace ddpx::comm::detail
