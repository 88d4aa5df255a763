#include "hooks/channel.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>

#include "hooks/stream_handoff.h"
#include "plugin/comm/issue_notice.h"

namespace ddpx::hooks {

Channel::Channel(comm::ProcessGroupPtr pg, int in_flight) : pg_(std::move(pg)) {
  TORCH_CHECK(in_flight >= 1, "Channel: in_flight must be at least 1, got ", in_flight);
  for (int i = 0; i < in_flight; ++i) {
    threads_.emplace_back([this] {
      // SCHED_BATCH: waking this thread never preempts the waker. The waker
      // is backward, in a gradient hook, launching a bucket; on a busy core
      // it should finish its backward time slice (the critical path) rather
      // than yield to the reduction at once. Best effort: ignored if refused.
      sched_param sp{};
      pthread_setschedparam(pthread_self(), SCHED_BATCH, &sp);
      loop();
    });
  }
}

Channel::~Channel() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

std::future<void> Channel::submit(std::function<void(c10d::ProcessGroup&)> fn, Tail tail) {
  std::packaged_task<void()> task([this, fn = std::move(fn)] { fn(*pg_); });
  auto fut = task.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    const bool overlaps = tail == Tail::kOverlaps && threads_.size() > 1;
    queue_.push_back({std::move(task), next_id_++, overlaps && last_overlaps_, overlaps});
    last_overlaps_ = overlaps;
  }
  cv_.notify_all();
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

bool Channel::may_start(const Job& job) const {
  return job.after_issue ? issued_upto_ >= job.id : done_below_ >= job.id;
}

void Channel::issued(uint64_t id) { issued_upto_ = std::max(issued_upto_, id + 1); }

void Channel::loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      // (Taken in queue order, so the jobs this one waits for are running.)
      cv_.wait(lock, [&] { return may_start(job); });
    }
    std::function<void()> notice = [this, id = job.id] {
      {
        std::lock_guard<std::mutex> lock(mu_);
        issued(id);
      }
      cv_.notify_all();
    };
    auto* outer = comm::detail::set_issue_notice(job.tells ? &notice : nullptr);
    job.task();  // exceptions land in the task's future
    comm::detail::set_issue_notice(outer);
    {
      std::lock_guard<std::mutex> lock(mu_);
      issued(job.id);
      if (job.id == done_below_) {
        ++done_below_;
        while (!done_ahead_.empty() && *done_ahead_.begin() == done_below_) {
          done_ahead_.erase(done_ahead_.begin());
          ++done_below_;
        }
      } else {
        done_ahead_.insert(job.id);
      }
    }
    cv_.notify_all();
  }
}

}  // namespace ddpx::hooks
