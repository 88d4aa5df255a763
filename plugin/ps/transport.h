#pragma once
// Moving the parameter server's bytes: an Inbox that takes every message
// addressed to this rank (any source, any size) on a progress thread of its
// own, and an Outbox of nonblocking sends whose buffers it keeps alive until
// MPI is done with them. Polling is paced by comm's WaitPacer, so an idle
// server does not burn the core a worker on the same host computes on.
#include <ATen/core/Tensor.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace ddpx::ps::detail {

struct Message {
  int source = 0;
  int tag = 0;
  at::Tensor bytes;  // uint8
};

// Step 2 of the protocol: MPI_Improbe(ANY_SOURCE, ANY_TAG) -> MPI_Get_count
// -> MPI_Mrecv into a buffer of exactly that size. The matched probe takes
// the message out of the matching queue, so no other receive on this
// communicator can steal it between the probe and the receive.
class Inbox {
 public:
  explicit Inbox(MPI_Comm comm);
  ~Inbox();
  // The next message, or nullopt after `wait` with none. Rethrows an MPI
  // error of the progress thread.
  std::optional<Message> pop(std::chrono::microseconds wait);
  // A message that did not come through MPI (LocalLink: a colocated rank's
  // worker to its own server), queued behind those already in.
  void post(Message m);
  void stop();

 private:
  void loop();

  MPI_Comm comm_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Message> queue_;
  std::string error_;
  std::thread thread_;
};

class Outbox {
 public:
  explicit Outbox(MPI_Comm comm) : comm_(comm) {}
  ~Outbox();
  // Sends `bytes` (uint8, contiguous; kept alive until sent) to `dest`.
  void send(const at::Tensor& bytes, int dest, int tag);
  // Completes what MPI finished; returns the number still in flight.
  size_t progress();
  // Waits for every send; false if some were still in flight after `limit`.
  bool drain(std::chrono::duration<double> limit);
  // Gives up on the sends to `dest` (a worker the server dropped: they may
  // never complete): no longer waited for, their buffers left to MPI.
  void abandon(int dest);

 private:
  MPI_Comm comm_;
  std::vector<MPI_Request> requests_;
  std::vector<at::Tensor> buffers_;
  std::vector<int> dests_;
};

}  // namespace ddpx::ps::detail
