#pragma once
// A communication channel: one process group and the threads that run the
// reductions queued on it, in order. Buckets go round-robin over channels
// (the DDP paper's round-robin process groups); the threads are what let a
// reduction (codec encode, collective, decode) run while backward computes.
//
// In flight: with `in_flight` > 1, a job submitted with Tail::kOverlaps
// right after another such job starts once that one has started its last
// collective (comm::detail::notify_last_issue, plugin/comm/issue_notice.h),
// not once it has ended: its collective goes on the wire while the first
// one's is still there, as DDP's buckets do on PyTorch's Gloo group (two
// threads). Every rank starts them in the order queued, which is what
// pairs them up. Any other job waits for every job queued before it to end.
#include <c10/core/Stream.h>
#include <ddpx/comm.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace ddpx::hooks {

class Channel {
 public:
  // in_flight: jobs that may run at once (threads); at least 1.
  explicit Channel(comm::ProcessGroupPtr pg, int in_flight = 1);
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  enum class Tail {
    kSerial,    // runs alone: after every job before it has ended
    kOverlaps,  // starts its collectives in one go, the last one told by
                // notify_last_issue (else its end counts): the next kOverlaps
                // job may start then
  };
  // Runs `fn(pg)` on a channel thread, in queue order as above.
  std::future<void> submit(std::function<void(c10d::ProcessGroup&)> fn, Tail tail = Tail::kSerial);
  c10d::ProcessGroup& pg() { return *pg_; }
  // The stream this channel's reductions on device `d` run on (a device with
  // streams: stream_handoff.h), taken from the device's pool on first use.
  c10::Stream stream(c10::Device d);

 private:
  struct Job {
    std::packaged_task<void()> task;
    uint64_t id = 0;
    bool after_issue = false;  // it and the job before it are kOverlaps
    bool tells = false;        // kOverlaps: its notice lets the next one start
  };
  void loop();
  bool may_start(const Job& job) const;  // under mu_
  void issued(uint64_t id);              // under mu_
  comm::ProcessGroupPtr pg_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  uint64_t next_id_ = 0;
  bool last_overlaps_ = false;  // the last job queued was kOverlaps
  // Progress, under mu_: every job below done_below_ has ended (and those in
  // done_ahead_); every job up to issued_upto_ - 1 has started its last
  // collective (they start in order, so one count says it).
  uint64_t done_below_ = 0, issued_upto_ = 0;
  std::set<uint64_t> done_ahead_;
  bool stop_ = false;
  std::vector<c10::Stream> streams_;  // under mu_: one per device used
  std::vector<std::thread> threads_;
};

}  // namespace ddpx::hooks
