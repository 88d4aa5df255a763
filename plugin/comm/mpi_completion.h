#pragma once
// Where a ddpx_mpi Future completes, and so where its callbacks run.
//
// c10::ivalue::Future runs its callbacks inside markCompleted. Run there on
// the MPI progress thread (mpi_work.h), a callback that issues a collective
// and waits on it (PyTorch's PowerSGD hook does) would wait for the only
// thread that can progress it: a deadlock no timeout ends. So a Work whose
// Future was handed out completes on this queue instead:
//   1. Completions run one at a time, in the order the worker finished them,
//      on a thread of this queue (one thread "serves" the queue). What order
//      the collectives they issue reach MPI in is not this queue's doing:
//      post_order.h sets it, the same on every rank, whichever thread runs
//      which callback when.
//   2. A callback that blocks must not stop the queue: when it posts a
//      collective of its own (note_blocking, called by MpiBackend::post) the
//      thread gives up serving at once, and when one completion has run for
//      kStall with others waiting behind it, a standby thread takes over.
//      From then on the two callbacks may run concurrently, as Gloo's do on
//      its several worker threads.
//   3. A standby thread is kept whenever one serves; threads idle for
//      kRetire leave, so a quiet process keeps none.
#include <chrono>
#include <functional>

namespace ddpx::comm::detail {

class CompletionQueue {
 public:
  static constexpr auto kStall = std::chrono::milliseconds(20);
  static constexpr auto kRetire = std::chrono::seconds(10);

  // The process's queue (never destroyed: detached threads may still use it
  // at exit).
  static CompletionQueue& get();

  void push(std::function<void()> fn);

  // The calling thread is running a completion and is about to wait on
  // another collective: let another thread serve the queue. No-op on any
  // other thread.
  static void note_blocking();

  // Waits (at most `limit`) until every completion pushed so far has run and
  // been destroyed: the Works they held may be the last owners of tensors
  // whose Python objects need the interpreter, so a group being destroyed
  // drains them before Python can finalise (a thread that asks a finalised
  // interpreter for the GIL is ended by pthread_exit: std::terminate).
  // False on timeout, and at once on a completion thread.
  bool drain(std::chrono::milliseconds limit);

  struct Impl;  // public only so the .cpp's thread-local state can name it

 private:
  CompletionQueue();
  Impl* impl_;
};

}  // namespace ddpx::comm::detail
