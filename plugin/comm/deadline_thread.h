#pragma once
// One thread that watches many deadlines: arm(key, timeout), disarm(key),
// and for each key whose deadline passes while armed, `expire` runs once.
// The scheduling half of ddpx_mpi's watchdog (mpi_watchdog.h), apart so that
// its wake-up logic is tested on its own (tests/cpp/test_deadline_thread.cpp).
//
// `expire(key, timeout)` runs on the thread with the lock held (the key is
// already disarmed, so a concurrent disarm cannot free what it looks at);
// the action it returns, if any, runs after the lock is dropped, so that a
// slow action (asking the peers who is missing) never blocks arm/disarm.
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

namespace ddpx::comm::detail {

class DeadlineThread {
 public:
  using Clock = std::chrono::steady_clock;
  using Expire = std::function<std::function<void()>(void* key, std::chrono::milliseconds timeout)>;

  DeadlineThread(std::string thread_name, Expire expire);
  // Stops and joins the thread (pending deadlines are dropped).
  ~DeadlineThread();
  DeadlineThread(const DeadlineThread&) = delete;
  DeadlineThread& operator=(const DeadlineThread&) = delete;

  // Arms (or re-arms) `key`, `timeout` from now; a timeout <= 0 arms nothing.
  void arm(void* key, std::chrono::milliseconds timeout);
  // After disarm returns, `expire` is not called for `key`'s current arming.
  void disarm(void* key);

 private:
  struct Armed {
    Clock::time_point deadline;
    std::chrono::milliseconds timeout;
  };
  void loop();

  const std::string name_;
  const Expire expire_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<void*, Armed> armed_;
  // When the thread wakes by itself (max: never). Holds whenever the thread
  // waits, so arm() wakes it exactly when it arms an earlier deadline.
  Clock::time_point wake_ = Clock::time_point::max();
  bool stopping_ = false;
  std::thread thread_;  // started on the first arm()
};

}  // namespace ddpx::comm::detail
