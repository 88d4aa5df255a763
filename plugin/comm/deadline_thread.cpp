#include "plugin/comm/deadline_thread.h"

#include <sys/prctl.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace ddpx::comm::detail {

DeadlineThread::DeadlineThread(std::string thread_name, Expire expire)
    : name_(std::move(thread_name)), expire_(std::move(expire)) {}

DeadlineThread::~DeadlineThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void DeadlineThread::arm(void* key, std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) return;
  // Clamped so that now + timeout cannot overflow the clock.
  const auto deadline =
      Clock::now() + std::min<std::chrono::milliseconds>(timeout, std::chrono::hours(24 * 365));
  std::lock_guard<std::mutex> lock(mu_);
  armed_[key] = {deadline, timeout};
  if (!thread_.joinable()) {
    wake_ = deadline;  // the thread's first wait is until this
    thread_ = std::thread([this] {
      prctl(PR_SET_NAME, name_.substr(0, 15).c_str(), 0, 0, 0);
      loop();
    });
  } else if (deadline < wake_) {
    wake_ = deadline;
    cv_.notify_one();
  }
}

void DeadlineThread::disarm(void* key) {
  std::lock_guard<std::mutex> lock(mu_);
  armed_.erase(key);  // wake_ may now be early: the thread then just looks again
}

void DeadlineThread::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<std::function<void()>> actions;
  while (!stopping_) {
    // No predicate: whatever woke us (arm, a deadline, a spurious wake-up),
    // the scan below recomputes wake_ from armed_ before the next wait. (A
    // predicate wait on "something armed" once swallowed an arm() that was
    // disarmed before this thread ran, leaving wake_ at that dead deadline
    // while the thread slept with none: the next, later deadline never fired.)
    if (wake_ == Clock::time_point::max()) {
      cv_.wait(lock);
    } else {
      cv_.wait_until(lock, wake_);
    }
    if (stopping_) break;
    const auto now = Clock::now();
    wake_ = Clock::time_point::max();
    for (auto it = armed_.begin(); it != armed_.end();) {
      if (it->second.deadline <= now) {
        void* key = it->first;
        const auto timeout = it->second.timeout;
        it = armed_.erase(it);
        if (auto action = expire_(key, timeout)) actions.push_back(std::move(action));
      } else {
        wake_ = std::min(wake_, it->second.deadline);
        ++it;
      }
    }
    if (actions.empty()) continue;
    // Unlocked: arm() may lower wake_ meanwhile, which the wait above honours.
    lock.unlock();
    for (auto& action : actions) action();
    actions.clear();
    lock.lock();
  }
}

}  // namespace ddpx::comm::detail
