#include "hooks/channel.h"

#include <pthread.h>
#include <sched.h>

#include "hooks/stream_handoff.h"

namespace ddpx::hooks {

Channel::Channel(comm::ProcessGroupPtr pg) : pg_(std::move(pg)) {
  thread_ = std::thread([this] {
    // SCHED_BATCH: waking this thread never preempts the waker. The waker is
    // backward, in a gradient hook, launching a bucket; on a busy core it
    // should finish its backward time slice (the critical path) rather than
    // yield to the reduction at once. Best effort: ignored if refused.
    sched_param sp{};
    pthread_setschedparam(pthread_self(), SCHED_BATCH, &sp);
    loop();
  });
}

Channel::~Channel() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::future<void> Channel::submit(std::function<void(c10d::ProcessGroup&)> fn) {
  std::packaged_task<void()> task([this, fn = std::move(fn)] { fn(*pg_); });
  auto fut = task.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
  return fut;
}

c10::Stream Channel::stream(c10::Device d) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& s : streams_) {
    if (s.device() == d) return s;
  }
  streams_.push_back(pool_stream(d));
  return streams_.back();
}

void Channel::loop() {
  for (;;) {
    std::packaged_task<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();  // exceptions land in the task's future
  }
}

}  // namespace ddpx::hooks
