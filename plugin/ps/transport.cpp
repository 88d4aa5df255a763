#include "plugin/ps/transport.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <deque>
#include <vector>

#include "plugin/comm/mpi_env.h"
#include "plugin/comm/wait_pacer.h"

namespace ddpx::ps::detail {

using comm::detail::WaitPacer;

Inbox::Inbox(MPI_Comm comm) : comm_(comm) {
  thread_ = std::thread([this] { loop(); });
}

Inbox::~Inbox() { stop(); }

void Inbox::stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void Inbox::loop() {
  // Receives are nonblocking (MPI_Imrecv): a matched message whose sender
  // dies half way (kill -9 mid-push) never completes, and a blocking
  // MPI_Mrecv would stall every other worker's messages behind it. Such a
  // receive stays in `pending` (its buffer with it) while the rest go on;
  // the server drops its sender after the timeout. Messages are handed on in
  // the order they matched, per source (a push before the same worker's BYE).
  struct Pending {
    MPI_Request request;
    Message message;
  };
  std::deque<Pending> pending;
  auto deliver_completed = [&] {
    bool any = false;
    std::vector<int> blocked;  // sources with an earlier receive still in flight
    for (auto it = pending.begin(); it != pending.end();) {
      const bool behind =
          std::find(blocked.begin(), blocked.end(), it->message.source) != blocked.end();
      int done = 0;
      if (!behind) DDPX_MPI_CHECK(MPI_Test(&it->request, &done, MPI_STATUS_IGNORE));
      if (!done) {
        blocked.push_back(it->message.source);
        ++it;
        continue;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        queue_.push_back(std::move(it->message));
      }
      cv_.notify_one();
      it = pending.erase(it);
      any = true;
    }
    return any;
  };
  try {
    auto pacer = WaitPacer(WaitPacer::Clock::now());
    while (!stop_) {
      int flag = 0;
      MPI_Message handle;
      MPI_Status status;
      const auto t0 = WaitPacer::Clock::now();
      DDPX_MPI_CHECK(MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, &handle, &status));
      if (flag) {
        int count = 0;
        DDPX_MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &count));
        pending.push_back({MPI_REQUEST_NULL, Message{status.MPI_SOURCE, status.MPI_TAG,
                                                     at::empty({count}, at::kByte)}});
        Pending& p = pending.back();
        DDPX_MPI_CHECK(
            MPI_Imrecv(p.message.bytes.data_ptr(), count, MPI_BYTE, &handle, &p.request));
      }
      if (deliver_completed() || flag) {
        pacer = WaitPacer(WaitPacer::Clock::now());  // the next message often follows soon
        continue;
      }
      const auto nap = pacer.after_test(t0, WaitPacer::Clock::now());
      if (nap.count() > 0) std::this_thread::sleep_for(nap);
    }
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = e.what();
    cv_.notify_one();
  }
  // A receive still in flight cannot be cancelled (it matched): MPI may
  // still write its buffer, so the buffer outlives us.
  for (auto& p : pending) new at::Tensor(p.message.bytes);
}

void Inbox::post(Message m) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(m));
  }
  cv_.notify_one();
}

std::optional<Message> Inbox::pop(std::chrono::microseconds wait) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, wait, [&] { return !queue_.empty() || !error_.empty(); });
  TORCH_CHECK(error_.empty(), "ddpx ps: the server's receive thread failed: ", error_);
  if (queue_.empty()) return std::nullopt;
  Message m = std::move(queue_.front());
  queue_.pop_front();
  return m;
}

Outbox::~Outbox() {
  // Buffers must outlive their sends; an Outbox dies only after drain() or
  // when its owner fails, and then MPI is aborted at exit.
  if (!requests_.empty() && !drain(std::chrono::seconds(1))) {
    comm::detail::MpiEnv::get().mark_broken("ddpx ps: sends still in flight at shutdown");
    for (auto& b : buffers_) new at::Tensor(b);  // leak: MPI may still read them
  }
}

void Outbox::send(const at::Tensor& bytes, int dest, int tag) {
  TORCH_INTERNAL_ASSERT(bytes.scalar_type() == at::kByte && bytes.is_contiguous());
  MPI_Request r;
  DDPX_MPI_CHECK(
      MPI_Isend(bytes.data_ptr(), static_cast<int>(bytes.numel()), MPI_BYTE, dest, tag, comm_, &r));
  requests_.push_back(r);
  buffers_.push_back(bytes);
  dests_.push_back(dest);
}

void Outbox::abandon(int dest) {
  for (size_t i = 0; i < requests_.size();) {
    if (dests_[i] != dest) {
      ++i;
      continue;
    }
    new at::Tensor(buffers_[i]);  // leaked: MPI may still read it
    const auto at = static_cast<std::ptrdiff_t>(i);
    requests_.erase(requests_.begin() + at);
    buffers_.erase(buffers_.begin() + at);
    dests_.erase(dests_.begin() + at);
  }
}

size_t Outbox::progress() {
  for (size_t i = 0; i < requests_.size();) {
    int done = 0;
    DDPX_MPI_CHECK(MPI_Test(&requests_[i], &done, MPI_STATUS_IGNORE));
    if (done) {
      const auto at = static_cast<std::ptrdiff_t>(i);
      requests_.erase(requests_.begin() + at);
      buffers_.erase(buffers_.begin() + at);
      dests_.erase(dests_.begin() + at);
    } else {
      ++i;
    }
  }
  return requests_.size();
}

bool Outbox::drain(std::chrono::duration<double> limit) {
  const auto deadline = WaitPacer::Clock::now() + limit;
  auto pacer = WaitPacer(WaitPacer::Clock::now());
  while (true) {
    const auto t0 = WaitPacer::Clock::now();
    if (progress() == 0) return true;
    if (t0 > deadline) return false;
    const auto nap = pacer.after_test(t0, WaitPacer::Clock::now());
    if (nap.count() > 0) std::this_thread::sleep_for(nap);
  }
}

}  // namespace ddpx::ps::detail
