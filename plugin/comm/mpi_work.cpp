#include "plugin/comm/mpi_work.h"

#include <ATen/core/ivalue.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <sys/prctl.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <string>

#include "plugin/comm/flight_recorder.h"
#include "plugin/comm/flight_triggers.h"
#include "plugin/comm/mpi_completion.h"
#include "plugin/comm/mpi_env.h"
#include "plugin/comm/mpi_watchdog.h"

namespace ddpx::comm::detail {

namespace {

std::vector<c10::Device> cuda_devices(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::Device> devices;
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.is_cuda() &&
        std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
      devices.push_back(t.device());
    }
  }
  return devices;
}

}  // namespace

MpiWork::MpiWork(int rank, c10d::OpType type, std::string what, std::vector<at::Tensor> outputs,
                 std::chrono::milliseconds timeout, const char* profiling_title,
                 const std::optional<std::vector<at::Tensor>>& inputs)
    : c10d::Work(rank, type, profiling_title, inputs),
      what_(std::move(what)),
      outputs_(std::move(outputs)),
      timeout_(timeout),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()), cuda_devices(outputs_))) {}

int MpiWork::sourceRank() const {
  const int r = source_rank_.load();
  TORCH_CHECK(r >= 0, "ddpx_mpi: sourceRank() is only known for a completed recvAnysource");
  return r;
}

c10::intrusive_ptr<c10::ivalue::Future> MpiWork::getFuture() {
  std::lock_guard<std::mutex> lock(done_mu_);
  // Callbacks attached from now on may issue collectives: they go ahead of
  // whatever is issued after this (post_order.h, step 1). Once the Work is
  // done, callbacks run at once on the caller's thread, in its order.
  if (!future_out_ && !done_ && order_) chain_ = order_->open_chain(this);
  future_out_ = true;
  return future_;
}

MpiWork::~MpiWork() { unwatch(this); }

namespace {
int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

void MpiWork::mark_started() {
  if (timed_) started_ns_ = steady_ns();
  FlightRecorder::get().started(record_);
}

float MpiWork::getDuration() const {
  TORCH_CHECK(timed_, "ddpx_mpi: getDuration() needs collective timing: call the process group's "
                      "_enable_collectives_timing() (enableCollectivesTiming) before the call");
  const int64_t end = ended_ns_.load();
  TORCH_CHECK(end != 0, "ddpx_mpi: getDuration() of ", what_, " before it completed");
  const int64_t start = started_ns_.load();
  return start == 0 ? 0.0f : static_cast<float>(end - start) / 1e6f;
}

void MpiWork::complete(std::exception_ptr error) {
  std::unique_lock<std::mutex> lock(done_mu_);
  if (completing_) return;
  completing_ = true;
  lock.unlock();
  if (timed_) ended_ns_ = steady_ns();
  unwatch(this);  // while the caller still holds this Work (mpi_watchdog.h)
  FlightRecorder::get().finished(record_, error != nullptr);
  if (error) fr_dump_after_failure("ddpx_mpi: " + what_ + " failed");
  lock.lock();
  if (future_out_) {
    lock.unlock();
    // Callbacks may be attached, and may wait on other collectives: not on
    // the worker (mpi_completion.h).
    CompletionQueue::get().push(
        [self = c10::intrusive_ptr<MpiWork>::unsafe_reclaim_from_nonowning(this), error] {
          std::optional<PostOrder::Running> running;  // what the callbacks issue is theirs
          if (self->chain_) running.emplace(self->chain_);
          self->finish_now(self->set_future(error));
        });
    return;
  }
  // Nobody holds the Future, so it has no callbacks: completing it here runs
  // no user code, and getFuture() waits for the lock, so none is attached
  // before the Future is complete (addCallback then runs it on its caller).
  const std::exception_ptr result = set_future(error);
  lock.unlock();
  finish_now(result);
}

std::exception_ptr MpiWork::set_future(const std::exception_ptr& error) {
  if (error) {
    future_->setErrorIfNeeded(error);
    return error;
  }
  // With devices, completing records CUDA events, which a device error can
  // make fail: the Work then fails with it (never left uncompleted).
  try {
    const c10::OptionalStreamGuard guard(stream_);  // the events on the caller's stream
    future_->markCompleted(c10::IValue(outputs_));
  } catch (...) {
    future_->setErrorIfNeeded(std::current_exception());
    return std::current_exception();
  }
  return future_->hasError() ? future_->exception_ptr() : nullptr;
}

void MpiWork::finish_now(std::exception_ptr error) {
  // After the Future: a waiter woken by finish() may read the future at once.
  finish(error);
  std::vector<std::function<void(std::exception_ptr)>> hooks;
  {
    std::lock_guard<std::mutex> lock(done_mu_);
    done_ = true;
    error_ = error;
    hooks.swap(on_done_);
  }
  for (auto& fn : hooks) fn(error);
  if (order_) order_->finished(chain_, issued_by_);  // after done_: chain_ is final
}

void MpiWork::on_done(std::function<void(std::exception_ptr)> fn) {
  {
    std::lock_guard<std::mutex> lock(done_mu_);
    if (!done_) {
      on_done_.push_back(std::move(fn));
      return;
    }
  }
  fn(error_);
}

void MpiWork::time_out(std::chrono::milliseconds limit) {
  // The watchdog and a waiter may both get here: the first reports, the
  // second waits for that report (so the peers are asked once, by whoever
  // comes first, and both see the message that names them).
  std::lock_guard<std::mutex> once(timeout_mu_);
  {
    std::lock_guard<std::mutex> lock(done_mu_);
    if (completing_) return;
  }
  // Only the process's first timeout asks the peers: after it, MPI is
  // broken and the job is ending. Only where several threads may call MPI
  // at once: the worker may be inside MPI now. Calls that time out together
  // (GradSync has two buckets in flight) wait for that answer and carry it
  // too: whichever the caller waits on first is the error it reports.
  struct Asked {
    std::mutex mu;
    bool done = false;
    std::string answer;
  };
  static auto* asked = new Asked();  // leaked on purpose: a timeout may come at exit
  std::string who;
  {
    std::lock_guard<std::mutex> lock(asked->mu);
    if (asked->done) {
      who = asked->answer;
    } else if (diagnose_ && MpiEnv::get().multiple() && !MpiEnv::get().broken()) {
      asked->done = true;
      who = asked->answer = diagnose_();
    }
  }
  const std::string msg =
      "ddpx_mpi: rank " + std::to_string(rank_) + " timed out after " +
      std::to_string(limit.count()) + " ms waiting for " + what_ + ": " +
      (who.empty() ? "a peer rank died, is stopped, or did not make the same call" : who) +
      "; if the peers are only slow, raise the timeout with init_process_group(timeout=...) or "
      "DDPX_TIMEOUT_S";
  MpiEnv::get().mark_broken(msg);
  std::exception_ptr error;
  try {
    C10_THROW_ERROR(DistBackendError, msg);
  } catch (...) {
    error = std::current_exception();
  }
  complete(error);
}

bool MpiWork::wait(std::chrono::milliseconds timeout) {
  const auto limit = timeout == kNoTimeout ? timeout_ : timeout;
  if (!isCompleted()) {
    // A callback waiting on a call held behind it lets it go first.
    if (order_) order_->waiting_on(this);
    // A callback waiting here holds the completion queue: let it move on.
    CompletionQueue::note_blocking();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  if (!cv_.wait_for(lock, limit, [this] { return completed_; })) {
    lock.unlock();  // the worker may still complete this Work meanwhile
    time_out(limit);
    lock.lock();
    // Complete now, or about to be (delivered by the completion queue).
    cv_.wait(lock, [this] { return completed_; });
  }
  if (exception_) std::rethrow_exception(exception_);
  future_->wait();  // (complete: with devices, the waiter's streams wait for its events)
  return true;
}

MpiWorker::MpiWorker(std::string name)
    : name_(std::move(name)), exited_future_(exited_.get_future().share()) {
  thread_ = std::thread([this] {
    // Timer slack 1 us (default 50): await_request's naps start at 10 us,
    // and a small collective should not wait 60 for its answer.
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    loop();
  });
}

MpiWorker::~MpiWorker() {
  if (stop(std::chrono::seconds(5))) return;
  if (thread_.joinable()) {
    // Stuck inside MPI: the process will abort the job at exit; do not block
    // the destructor (and the caller) forever.
    thread_.detach();
    return;
  }
  // Stopped with sends or receives never matched (kept: keep_unmatched).
  // Their Works fail now: a holder of their Future alone would wait forever
  // (here, not at exit, where a Future's callbacks may need an interpreter
  // that is gone).
  try {
    C10_THROW_ERROR(DistBackendError,
                    "ddpx_mpi: the backend was destroyed before this send or receive was matched");
  } catch (...) {
    const std::exception_ptr error = std::current_exception();
    try {
      for (auto& work : unmatched_) work->complete(error);
    } catch (...) {
      // (no thread for the completion queue: they time out if waited on)
    }
  }
}

bool MpiWorker::stop(std::chrono::milliseconds grace) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (!thread_.joinable()) return true;
  if (exited_future_.wait_for(grace) != std::future_status::ready) return false;
  thread_.join();
  return !abandoned_;
}

void MpiWorker::enqueue(c10::intrusive_ptr<MpiWork> work, Task task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!stopping_, "ddpx_mpi: the backend was shut down");
    queue_.push_back({std::move(work), std::move(task)});
  }
  cv_.notify_one();
}

void MpiWorker::run_sync(const std::function<void()>& fn) {
  std::promise<void> done;
  auto fut = done.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!stopping_, "ddpx_mpi: the backend was shut down");
    queue_.push_back({{}, [&](Progress&) {
                        try {
                          fn();
                          done.set_value();
                        } catch (...) {
                          done.set_exception(std::current_exception());
                        }
                      }});
  }
  cv_.notify_one();
  fut.get();
}

void MpiWorker::poll_pending() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    std::exception_ptr error;
    bool all_done = true;
    try {
      for (auto& item : it->items) {
        if (item.request == MPI_REQUEST_NULL) continue;
        int flag = 0;
        MPI_Status status;
        DDPX_MPI_CHECK(MPI_Test(&item.request, &flag, &status));
        if (!flag) {
          all_done = false;
          continue;
        }
        item.request = MPI_REQUEST_NULL;
        item.on_done(status);
      }
    } catch (...) {
      error = std::current_exception();
      all_done = true;
    }
    if (all_done) {
      it->work->complete(error);
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
}

void MpiWorker::loop() {
  for (;;) {
    Entry entry;
    bool stopping = false;  // stopping_ as seen under mu_ (stop() sets it from another thread)
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (pending_.empty()) {
        cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      } else {
        // Requests in flight: poll them often, but sleep when nothing comes.
        cv_.wait_for(lock, std::chrono::microseconds(50),
                     [this] { return stopping_ || !queue_.empty(); });
      }
      stopping = stopping_;
      if (stopping && queue_.empty() && pending_.empty()) break;
      if (!queue_.empty()) {
        entry = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
    }
    if (entry.task) {
      if (entry.work) {
        entry.work->mark_started();
        watch(entry.work.get(), entry.work->timeout());
      }
      Progress progress;
      progress.work = entry.work.get();
      std::exception_ptr error;
      try {
        entry.task(progress);
      } catch (...) {
        error = std::current_exception();
      }
      if (entry.work) {
        if (error || progress.deferred.empty()) {
          entry.work->complete(error);
        } else {
          pending_.push_back({entry.work, std::move(progress.deferred)});
        }
      }
    }
    if (!pending_.empty()) poll_pending();
    entry = {};  // this thread's reference to the Work goes before the worker counts as idle
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
      idle_ = queue_.empty() && pending_.empty();
      if (idle_) idle_cv_.notify_all();
      if (stopping && !pending_.empty() && queue_.empty()) {
        abandoned_ = true;  // requests that never matched: MPI cannot finalise
        break;
      }
    }
  }
  if (abandoned_) keep_unmatched();
  exited_.set_value();
}

void MpiWorker::keep_unmatched() {
  // A receive is cancelled: once its cancel has completed (locally), MPI
  // writes its buffer no more. A send cannot be (MPI 4 deprecates it, and
  // Open MPI does not cancel sends) and a late peer may still match it, when
  // MPI reads its buffer, which its completion owns: it and its completion
  // live as long as the process, and one still unmatched at exit ends the
  // job with MPI_Abort (MPI_Finalize may wait for it forever). Their Works
  // fail when the worker is destroyed.
  static auto* mu = new std::mutex();                       // leaked on purpose: used at exit
  static auto* kept = new std::vector<Progress::Item>();  // the same
  std::lock_guard<std::mutex> lock(*mu);
  for (auto& p : pending_) {
    for (auto& item : p.items) {
      if (item.request == MPI_REQUEST_NULL) continue;
      if (item.receive) {
        MPI_Cancel(&item.request);
        MPI_Wait(&item.request, MPI_STATUS_IGNORE);
        continue;
      }
      int done = 0;
      if (MPI_Test(&item.request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) continue;
      kept->push_back(std::move(item));
    }
    unmatched_.push_back(std::move(p.work));
  }
  pending_.clear();
  static bool checked_at_exit = false;
  if (!kept->empty() && !checked_at_exit) {
    checked_at_exit = true;
    MpiEnv::get().on_shutdown([] {
      std::lock_guard<std::mutex> lock(*mu);
      for (auto& item : *kept) {
        int done = 0;
        if (MPI_Test(&item.request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done) {
          MpiEnv::get().mark_broken("a send of a destroyed ddpx_mpi backend was never received");
          break;
        }
      }
      return true;
    });
  }
}

bool MpiWorker::wait_idle(std::chrono::milliseconds limit) {
  std::unique_lock<std::mutex> lock(mu_);
  return idle_cv_.wait_for(lock, limit, [this] { return !busy_ && queue_.empty() && idle_; });
}

namespace {
std::mutex workers_mu;
std::vector<std::weak_ptr<MpiWorker>> workers;  // every worker made, for quiesce()
}  // namespace

void quiesce(std::chrono::milliseconds limit) {
  std::vector<std::shared_ptr<MpiWorker>> live;
  {
    std::lock_guard<std::mutex> lock(workers_mu);
    for (auto& w : workers) {
      if (auto s = w.lock()) live.push_back(std::move(s));
    }
  }
  // Twice: a completion may release collectives that were held behind its
  // callbacks (post_order.h).
  for (int round = 0; round < 2; ++round) {
    for (auto& w : live) w->wait_idle(limit);
    CompletionQueue::get().drain(limit);
  }
}

std::shared_ptr<MpiWorker> worker_for_new_backend() {
  MpiEnv& env = MpiEnv::get();
  auto make = [&env](const char* name) {
    auto w = std::make_shared<MpiWorker>(name);
    {
      std::lock_guard<std::mutex> lock(workers_mu);
      workers.erase(
          std::remove_if(workers.begin(), workers.end(), [](const auto& x) { return x.expired(); }),
          workers.end());
      workers.push_back(w);
    }
    std::weak_ptr<MpiWorker> weak = w;
    env.on_shutdown([weak] {
      auto strong = weak.lock();
      return !strong || strong->stop(std::chrono::seconds(5));
    });
    return w;
  };
  if (env.multiple()) return make("ddpx_mpi");
  static std::shared_ptr<MpiWorker> shared = make("ddpx_mpi_shared");
  return shared;
}

}  // namespace ddpx::comm::detail
