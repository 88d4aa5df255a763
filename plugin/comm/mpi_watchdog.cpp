#include "plugin/comm/mpi_watchdog.h"

#include <sys/prctl.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "plugin/comm/mpi_work.h"

namespace ddpx::comm::detail {
namespace {

using Clock = std::chrono::steady_clock;

class Watchdog {
 public:
  static Watchdog& get() {
    static auto* dog = new Watchdog();  // never destroyed: its thread is detached
    return *dog;
  }

  void add(MpiWork* work, std::chrono::milliseconds timeout) {
    if (timeout.count() <= 0) return;  // no deadline
    // Clamped so that now + timeout cannot overflow the clock.
    const auto deadline =
        Clock::now() + std::min<std::chrono::milliseconds>(timeout, std::chrono::hours(24 * 365));
    std::lock_guard<std::mutex> lock(mu_);
    armed_[work] = {deadline, timeout};
    if (deadline < next_) {
      next_ = deadline;
      cv_.notify_one();
    }
    if (!started_) {
      started_ = true;
      std::thread([this] {
        prctl(PR_SET_NAME, "ddpx_mpi_dog", 0, 0, 0);
        loop();
      }).detach();
    }
  }

  void remove(MpiWork* work) {
    std::lock_guard<std::mutex> lock(mu_);
    armed_.erase(work);  // next_ may now be early: the loop then just looks again
  }

 private:
  struct Armed {
    Clock::time_point deadline;
    std::chrono::milliseconds timeout;
  };

  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      // next_ is what this thread sleeps until, so that add() wakes it for an
      // earlier deadline (remove() may leave it early: one idle wake-up).
      if (armed_.empty()) {
        next_ = Clock::time_point::max();
        cv_.wait(lock, [this] { return !armed_.empty(); });
      } else {
        cv_.wait_until(lock, next_);
      }
      const auto now = Clock::now();
      std::vector<std::pair<c10::intrusive_ptr<MpiWork>, std::chrono::milliseconds>> expired;
      next_ = Clock::time_point::max();
      for (auto it = armed_.begin(); it != armed_.end();) {
        if (it->second.deadline <= now) {
          // Armed, so alive (see the header): a reference keeps it so while
          // it fails unlocked. (A count of 0 is a Work being destroyed
          // without completing, by a worker abandoned at exit; its
          // destructor waits for this lock to disarm it.)
          if (c10::raw::intrusive_ptr::use_count(it->first) == 0) {
            it = armed_.erase(it);
            continue;
          }
          expired.emplace_back(c10::intrusive_ptr<MpiWork>::reclaim_copy(it->first),
                               it->second.timeout);
          it = armed_.erase(it);
        } else {
          next_ = std::min(next_, it->second.deadline);
          ++it;
        }
      }
      // Failing a Work may ask the peers for up to a few seconds: unlocked,
      // so the worker can keep arming Works meanwhile.
      lock.unlock();
      for (auto& [work, timeout] : expired) work->time_out(timeout);
      expired.clear();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<MpiWork*, Armed> armed_;
  Clock::time_point next_ = Clock::time_point::max();
  bool started_ = false;
};

}  // namespace

void watch(MpiWork* work, std::chrono::milliseconds timeout) { Watchdog::get().add(work, timeout); }

void unwatch(MpiWork* work) { Watchdog::get().remove(work); }

}  // namespace ddpx::comm::detail
