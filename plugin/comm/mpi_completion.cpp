#include "plugin/comm/mpi_completion.h"

#include <sys/prctl.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>

namespace ddpx::comm::detail {

struct CompletionQueue::Impl {
  using Clock = std::chrono::steady_clock;

  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  uint64_t server = 0;  // id of the thread serving the queue; 0: none
  uint64_t next_id = 0;
  bool server_busy = false;         // the server is inside a completion
  Clock::time_point busy_since{};   // when that completion started
  int idle = 0;                     // threads waiting for work (incl. ones starting)
  int in_flight = 0;                // completions taken but not yet destroyed
  std::condition_variable drained;  // in_flight reached 0 with the queue empty

  void spawn_locked() {
    ++idle;
    std::thread([this] {
      prctl(PR_SET_NAME, "ddpx_mpi_done", 0, 0, 0);
      loop();
    }).detach();
  }

  // An idle thread may serve when nobody does, or take over from a server
  // whose completion has run for kStall (it is probably waiting on a
  // collective whose completion is queued behind it).
  bool may_serve_locked(Clock::time_point now) const {
    if (queue.empty()) return false;
    return server == 0 || (server_busy && now - busy_since >= kStall);
  }

  void loop();
};

namespace {

// The queue and server id of the completion this thread runs, if any.
struct Running {
  CompletionQueue::Impl* queue = nullptr;
  uint64_t id = 0;
};
thread_local Running running;

}  // namespace

void CompletionQueue::Impl::loop() {
  std::unique_lock<std::mutex> lock(mu);
  auto idle_since = Clock::now();
  for (;;) {
    const auto now = Clock::now();
    if (!may_serve_locked(now)) {
      // A standby must stay while someone serves (step 2 of the header).
      if (queue.empty() && now - idle_since >= kRetire && (server == 0 || idle > 1)) {
        --idle;
        return;
      }
      if (!queue.empty() && server_busy) {
        cv.wait_until(lock, busy_since + kStall);
      } else {
        cv.wait_for(lock, kRetire);
      }
      continue;
    }
    --idle;
    const uint64_t me = ++next_id;
    server = me;
    if (idle == 0) spawn_locked();
    while (server == me && !queue.empty()) {
      std::function<void()> fn = std::move(queue.front());
      queue.pop_front();
      ++in_flight;
      server_busy = true;
      busy_since = Clock::now();
      lock.unlock();
      running = {this, me};
      try {
        fn();
      } catch (...) {
        // A completion reports its own errors through its Work and Future.
      }
      running = {};
      fn = nullptr;  // the Work it held may be the last reference
      lock.lock();
      if (--in_flight == 0 && queue.empty()) drained.notify_all();
      if (server == me) server_busy = false;
    }
    if (server == me) server = 0;
    ++idle;
    idle_since = Clock::now();
    if (!queue.empty()) cv.notify_all();
  }
}

CompletionQueue::CompletionQueue() : impl_(new Impl) {}

CompletionQueue& CompletionQueue::get() {
  static auto* queue = new CompletionQueue();  // leaked on purpose, see the header
  return *queue;
}

void CompletionQueue::push(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->queue.push_back(std::move(fn));
    if (impl_->idle == 0) impl_->spawn_locked();
  }
  impl_->cv.notify_all();
}

bool CompletionQueue::drain(std::chrono::milliseconds limit) {
  if (running.queue == impl_) return false;  // from a completion: it would wait on itself
  std::unique_lock<std::mutex> lock(impl_->mu);
  return impl_->drained.wait_for(lock, limit,
                                 [this] { return impl_->queue.empty() && impl_->in_flight == 0; });
}

void CompletionQueue::note_blocking() {
  Impl* q = running.queue;
  if (q == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(q->mu);
    if (q->server != running.id) return;  // already taken over
    q->server = 0;
    q->server_busy = false;
  }
  q->cv.notify_all();
}

}  // namespace ddpx::comm::detail
