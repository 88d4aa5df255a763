#include "plugin/comm/mpi_watchdog.h"

#include <sys/prctl.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "plugin/comm/mpi_work.h"

namespace ddpx::comm::detail {
namespace {

using Clock = std::chrono::steady_clock;

// Wakes at the earliest deadline, and at least this often to drop the Works
// that completed (so their tensors are not kept alive by the list).
constexpr auto kSweep = std::chrono::milliseconds(200);

class Watchdog {
 public:
  static Watchdog& get() {
    static auto* dog = new Watchdog();  // never destroyed: its thread is detached
    return *dog;
  }

  void add(const c10::intrusive_ptr<MpiWork>& work, std::chrono::milliseconds timeout) {
    if (timeout.count() <= 0) return;  // no deadline
    // Clamped so that now + timeout cannot overflow the clock.
    const auto deadline =
        Clock::now() + std::min<std::chrono::milliseconds>(timeout, std::chrono::hours(24 * 365));
    std::lock_guard<std::mutex> lock(mu_);
    armed_.push_back({deadline, timeout, c10::weak_intrusive_ptr<MpiWork>(work)});
    if (armed_.size() == 1 || deadline < next_) {
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

 private:
  struct Armed {
    Clock::time_point deadline;
    std::chrono::milliseconds timeout;
    c10::weak_intrusive_ptr<MpiWork> work;
  };

  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (armed_.empty()) {
        cv_.wait(lock, [this] { return !armed_.empty(); });
      } else {
        cv_.wait_until(lock, std::min(next_, Clock::now() + kSweep));
      }
      const auto now = Clock::now();
      std::vector<std::pair<c10::intrusive_ptr<MpiWork>, std::chrono::milliseconds>> expired;
      next_ = Clock::time_point::max();
      std::vector<Armed> keep;
      keep.reserve(armed_.size());
      for (auto& a : armed_) {
        auto work = a.work.lock();
        if (!work || work->isCompleted()) continue;
        if (a.deadline <= now) {
          expired.emplace_back(std::move(work), a.timeout);
        } else {
          next_ = std::min(next_, a.deadline);
          keep.push_back(std::move(a));
        }
      }
      armed_ = std::move(keep);
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
  std::vector<Armed> armed_;
  Clock::time_point next_ = Clock::time_point::max();
  bool started_ = false;
};

}  // namespace

void watch(const c10::intrusive_ptr<MpiWork>& work, std::chrono::milliseconds timeout) {
  Watchdog::get().add(work, timeout);
}

}  // namespace ddpx::comm::detail
