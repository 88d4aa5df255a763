#pragma once
// A communication channel: one process group and one thread that runs the
// reductions queued on it, in order. Buckets go round-robin over channels
// (the DDP paper's round-robin process groups); the thread is what lets a
// reduction (codec encode, collective, decode) run while backward computes.
#include <c10/core/Stream.h>
#include <ddpx/comm.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace ddpx::hooks {

class Channel {
 public:
  explicit Channel(comm::ProcessGroupPtr pg);
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // Runs `fn(pg)` on the channel thread after everything queued before it.
  std::future<void> submit(std::function<void(c10d::ProcessGroup&)> fn);
  c10d::ProcessGroup& pg() { return *pg_; }
  // The stream this channel's reductions on device `d` run on (a device with
  // streams: stream_handoff.h), taken from the device's pool on first use.
  c10::Stream stream(c10::Device d);

 private:
  void loop();
  comm::ProcessGroupPtr pg_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> queue_;
  bool stop_ = false;
  std::vector<c10::Stream> streams_;  // under mu_: one per device used
  std::thread thread_;
};

}  // namespace ddpx::hooks
