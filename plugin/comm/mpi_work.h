#pragma once
// The Work handed back by every ddpx_mpi call, and the worker thread that
// runs the MPI side of it.
//
// Protocol (one worker per backend when MPI offers MPI_THREAD_MULTIPLE, one
// shared worker otherwise):
//   1. The caller's thread validates arguments and enqueues a task; the call
//      returns a Work at once.
//   2. The worker runs tasks in FIFO order, so every rank issues collectives
//      on a communicator in the order its caller made them. A collective runs
//      to completion on the worker while the caller computes: that thread is
//      the progress engine MPI does not have on its own. It posts the
//      nonblocking form and tests it, napping while no bytes move
//      (await_request, mpi_util.h), rather than spinning inside a blocking
//      call, so it leaves the cores to the compute it overlaps.
//   3. Point-to-point tasks only post MPI_Isend/MPI_Irecv and stay pending; the
//      worker tests them between tasks, so a send never blocks the queue (and
//      send-then-recv on both ranks cannot deadlock).
//   4. Completion finishes the Work and its Future (value: the output tensors)
//      or stores the exception. The worker does it itself while nobody holds
//      the Future; once getFuture() handed it out, callbacks may be attached,
//      and those may wait on further collectives, so the completion moves to
//      the CompletionQueue (mpi_completion.h) and the worker goes on. The
//      collectives those callbacks issue reach the worker in an order that is
//      the same on every rank (post_order.h).
//   5. Timeouts: the worker arms each Work's deadline when it starts it
//      (mpi_watchdog.h), so a wait on the Future, or none, is bounded too;
//      Work::wait(timeout) also throws on its own expiry. Either way the Work
//      fails with DistBackendError naming the collective and the peers behind
//      it where it can (the first timeout of the process asks the others, see
//      mpi_diagnose.h), and MPI is marked broken, so the process aborts the
//      job at exit instead of hanging in MPI_Finalize.
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "plugin/comm/post_order.h"
#include "plugin/torch_compat.h"

namespace ddpx::comm::detail {

class MpiWork : public c10d::Work {
 public:
  MpiWork(int rank, c10d::OpType type, std::string what, std::vector<at::Tensor> outputs,
          std::chrono::milliseconds timeout, const char* profiling_title,
          const std::optional<std::vector<at::Tensor>>& inputs);
  ~MpiWork() override;

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  // Read from the Future, which completes first: whoever woke on it sees
  // the Work completed too.
  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override {
    return future_->completed() ? future_->exception_ptr() : nullptr;
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  int sourceRank() const override;
#if DDPX_TORCH_AT_LEAST(2, 15)
  std::chrono::milliseconds getTimeout() const override { return timeout_; }
#endif
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Milliseconds from the worker starting the call to its completion; only
  // for Works posted after the group's enableCollectivesTiming() (as Gloo).
  float getDuration() const override;

  // The caller's stream of the tensors' device (unset for CPU tensors), set
  // before the Work is queued: where the device copies ran, so where the
  // Future records its events (below).
  void set_stream(std::optional<c10::Stream> stream) { stream_ = stream; }
  std::optional<c10::Stream> stream() const { return stream_; }

  // Called on a timeout to name the peers behind it (mpi_diagnose.h); the
  // sentence ends the error message.
  void set_diagnosis(std::function<std::string()> fn) { diagnose_ = std::move(fn); }

  // The group's post order (post_order.h), set before the Work is posted
  // there: its Future's callbacks then issue their collectives in order.
  // Without one (point-to-point calls) they are not ordered.
  void set_order(std::shared_ptr<PostOrder> order) { order_ = std::move(order); }
  // Its flight-recorder record (flight_recorder.h), stamped when the worker
  // starts it and when it completes; set before the worker can start it.
  void set_record(uint64_t id) { record_ = id; }
  uint64_t record() const { return record_; }
  // Where the order records the callbacks that issued this Work.
  std::shared_ptr<PostOrder::Chain>* issued_by() { return &issued_by_; }

  // Worker side. Only the first call counts: the watchdog and the worker may
  // both try to complete a Work that timed out.
  void complete(std::exception_ptr error);
  void set_source_rank(int rank) { source_rank_ = rank; }
  // Timing (getDuration): enabled by the backend before the Work is queued;
  // the worker marks the start, complete() the end.
  void enable_timing() { timed_ = true; }
  void mark_started();
  const std::string& what() const { return what_; }
  // Runs `fn` with the Work's error (null on success) once it is complete:
  // at once if it already is, else on the completing thread.
  void on_done(std::function<void(std::exception_ptr)> fn);

  // Fails the Work (if it is still running) with the timeout error for a
  // wait of `limit`, asking the peers first when this is the process's
  // first timeout; marks MPI broken. Returns when the Work is complete.
  void time_out(std::chrono::milliseconds limit);

 private:
  // Completes the Future with `error`, or the outputs; returns the error the
  // Work ends with (the Future's own, if completing it failed).
  std::exception_ptr set_future(const std::exception_ptr& error);
  void finish_now(std::exception_ptr error);

  std::string what_;
  std::vector<at::Tensor> outputs_;
  std::chrono::milliseconds timeout_;
  // With CUDA outputs, a Future of their devices (as Gloo's and NCCL's): its
  // events are recorded on stream_ when it completes, so `wait()` orders the
  // waiter's stream after the results and `then()` callbacks run on streams
  // that wait for them (not on the completing thread's default stream).
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::optional<c10::Stream> stream_;
  std::atomic<int> source_rank_{-1};
  bool timed_ = false;
  std::atomic<int64_t> started_ns_{0};  // steady clock; 0: not started
  std::atomic<int64_t> ended_ns_{0};    // 0: not complete
  std::function<std::string()> diagnose_;
  std::shared_ptr<PostOrder> order_;
  uint64_t record_ = 0;
  std::shared_ptr<PostOrder::Chain> issued_by_;
  std::shared_ptr<PostOrder::Chain> chain_;  // its own callbacks' (set once, under done_mu_)
  std::mutex done_mu_;                       // guards the five below
  bool future_out_ = false;                  // getFuture() was called
  bool completing_ = false;                  // complete() was called
  bool done_ = false;                        // finished; on_done_ ran
  std::exception_ptr error_;
  std::vector<std::function<void(std::exception_ptr)>> on_done_;
  std::mutex timeout_mu_;  // one timeout report per Work
};

class MpiWorker {
 public:
  // A task posts a request it wants tested later with Progress::defer.
  struct Progress {
    // `receive`: a receive, which a stopped worker cancels (keep_unmatched).
    void defer(MPI_Request request, std::function<void(const MPI_Status&)> on_done,
               bool receive = false) {
      deferred.push_back({request, std::move(on_done), receive});
    }
    struct Item {
      MPI_Request request;
      std::function<void(const MPI_Status&)> on_done;
      bool receive = false;
    };
    std::vector<Item> deferred;
    MpiWork* work = nullptr;  // the Work this task completes (alive until then)
  };
  using Task = std::function<void(Progress&)>;

  explicit MpiWorker(std::string name);
  ~MpiWorker();
  MpiWorker(const MpiWorker&) = delete;
  MpiWorker& operator=(const MpiWorker&) = delete;

  // Runs `task` after everything queued before it; finishes `work` when the
  // task (and any request it deferred) is done.
  void enqueue(c10::intrusive_ptr<MpiWork> work, Task task);
  // Runs `fn` on the worker and waits for it (communicator set-up).
  void run_sync(const std::function<void()>& fn);
  // Stops after the running task; false if the thread did not stop in `grace`.
  bool stop(std::chrono::milliseconds grace);
  // Waits (at most `limit`) until nothing is queued, running or pending and
  // the worker thread holds no Work. False on timeout.
  bool wait_idle(std::chrono::milliseconds limit);

 private:
  struct Entry {
    c10::intrusive_ptr<MpiWork> work;
    Task task;
  };
  struct Pending {
    c10::intrusive_ptr<MpiWork> work;
    std::vector<Progress::Item> items;
  };
  void loop();
  void poll_pending();
  // Stopped with requests never matched: cancels the receives and keeps the
  // sends with their memory.
  void keep_unmatched();

  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Entry> queue_;
  std::vector<Pending> pending_;  // touched by the worker thread only
  // Works of the requests keep_unmatched kept (read after the thread is joined).
  std::vector<c10::intrusive_ptr<MpiWork>> unmatched_;
  bool stopping_ = false;
  bool abandoned_ = false;  // stopped with requests that never completed
  bool busy_ = false;       // a task taken from queue_ is running or its entry is alive
  bool idle_ = true;        // nothing pending after the last task
  std::condition_variable idle_cv_;
  std::promise<void> exited_;
  std::shared_future<void> exited_future_;
  std::thread thread_;
};

// The worker a new backend should use (its own, or the shared one when MPI
// does not allow concurrent calls from several threads).
std::shared_ptr<MpiWorker> worker_for_new_backend();

// Before an embedding interpreter finalises (Python's atexit): waits, at most
// `limit` per stage, until every worker is idle and every Future completion
// has run, so no ddpx thread still holds a Work, whose tensors may need the
// GIL to be freed (mpi_watchdog.h says what happens when one asks then).
void quiesce(std::chrono::milliseconds limit);

}  // namespace ddpx::comm::detail
