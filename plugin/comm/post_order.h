#pragma once
// When a ddpx_mpi collective reaches the MPI worker: the ordering rule that
// makes collectives issued from Future callbacks reach MPI in the same order
// on every rank.
//
// MPI needs every rank to make the collectives of one communicator in one
// order. The caller's thread issues them in program order, but a Future
// callback (PyTorch's PowerSGD hook issues two all-reduces from the callbacks
// of each bucket's first one) runs whenever its Work completes, on a thread
// of the completion queue (mpi_completion.h): how its collectives interleave
// with the caller's, or with another callback's, is thread timing, which
// differs between ranks. So the order is fixed here, by the works' own order:
//
//   1. A Work's callbacks issue their collectives as if they ran when its
//      Future was handed out (getFuture), as NCCL's callbacks do, which run
//      at once: after everything issued before that, before anything issued
//      after it. Until the callbacks have returned (the Work's chain is
//      "settled"), a collective issued later waits here ("held"), and the
//      callbacks' own collectives go ahead of it, in the order they issue
//      them; a callback of a collective a callback issued nests the same way.
//      Attach callbacks before issuing the next collective (DDP's hooks do):
//      a callback attached later runs at once if the Work is done by then.
//   2. A callback that waits (Work::wait) on, or takes the Future of, a
//      collective held behind it yields to it: everything up to that
//      collective goes first, and the callback's later collectives after it.
//      This is program order, the same on every rank.
//   3. A callback that waits in a way this cannot see (Future::wait on a
//      Future taken elsewhere, a Python event) for something held behind it
//      would deadlock. When a running callback has no collective of its own
//      in flight and its thread has used no CPU for kIdleTicks x kTick
//      (200 ms), it yields to everything held. This is the one step timed by the clock: a callback
//      that issues further collectives after such a wait may issue them in
//      another order on another rank, which the agreement check before each
//      collective reports as an error (never a silent mix-up).
//
// Point-to-point calls are not ordered here (MPI matches them by source and
// tag, and holding a send behind a receive's callbacks could deadlock). The
// class knows nothing of MPI: a post is a `Release` that hands the call to
// the worker, under this object's lock, so releases keep their order.
// Thread-safe.
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>

namespace ddpx::comm::detail {

class PostOrder : public std::enable_shared_from_this<PostOrder> {
 public:
  static constexpr auto kTick = std::chrono::milliseconds(100);
  static constexpr int kIdleTicks = 2;
  // A tick counts as idle below this much CPU time of the callback's thread.
  static constexpr auto kIdleCpu = std::chrono::milliseconds(2);

  // `numbered`: the position of this collective among those released, the
  // number the ranks compare when one of them times out.
  using Release = std::function<void(uint64_t numbered)>;
  struct Chain;

  static std::shared_ptr<PostOrder> create() { return std::shared_ptr<PostOrder>(new PostOrder()); }

  // Posts the collective of Work `key` (nullptr: a task without a Work,
  // such as freeing the communicator; it is not numbered). `issued_by`
  // (null for a task without a Work) receives the chain that issued it
  // (null from the caller's thread), for finished() once the Work is done;
  // it is written before `release` can run.
  void post(const void* key, Release release, std::shared_ptr<Chain>* issued_by);
  // The Future of Work `key` was handed out before the Work completed:
  // collectives issued from now on wait for its callbacks (step 1).
  std::shared_ptr<Chain> open_chain(const void* key);
  // The calling thread is about to wait for Work `key` (step 2).
  void waiting_on(const void* key);
  // Work done, its callbacks returned: `own` (its chain, may be null)
  // settles, and `parent` has one collective fewer in flight.
  void finished(const std::shared_ptr<Chain>& own, const std::shared_ptr<Chain>& parent);

  // While alive, the calling thread runs `chain`'s callbacks: what it
  // issues is the chain's (step 1), and step 3 watches it.
  class Running {
   public:
    explicit Running(std::shared_ptr<Chain> chain);
    ~Running();
    Running(const Running&) = delete;
    Running& operator=(const Running&) = delete;

   private:
    std::shared_ptr<Chain> chain_;
    Chain* outer_;
  };

  // Calls held right now (for tests and diagnostics).
  size_t held() const;
  // Step 3's look at a running chain (the ticker thread calls it).
  void tick(const std::shared_ptr<Chain>& chain);

 private:
  struct Entry {
    const void* key;
    Release release;  // empty for a chain's barrier
    Chain* barrier_of;
  };
  using Entries = std::list<Entry>;

  PostOrder() = default;
  Chain* context_locked() const;
  Entries::iterator insertion_point_locked(Chain* context);
  // Moves `chain`'s barrier, and those of the chains waiting on it, to just
  // before `before` (where they are ahead of it).
  void yield_locked(Chain* chain, Entries::iterator before);
  // If Work `key` is held behind `chain`, yields past it.
  bool yield_past_locked(Chain* chain, const void* key);
  void release_locked();
  void arm_tick_locked(Chain* chain);

  mutable std::mutex mu_;
  // Not yet released, in release order; a chain's barrier stands where its
  // callbacks' collectives go.
  Entries entries_;
  uint64_t numbered_ = 0;
};

}  // namespace ddpx::comm::detail
