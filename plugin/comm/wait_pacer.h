#pragma once
// When to test a pending nonblocking MPI request again (ddpx_mpi's
// await_request): at once, or after a nap. Open MPI moves bytes only inside
// MPI_Test, so testing too rarely slows the transfer, and testing in a loop
// burns a core the caller's backward needs. Pure logic on the times of each
// test, so the tests can drive it with a made-up clock.
//
// - An idle MPI_Test returns in under half a microsecond (measured); one
//   that takes longer moved bytes (a socket read or write, a shared-memory
//   fragment): a working test.
// - The first 300 us always spin: a small or mid-size collective (shared
//   memory: 1 MB in 0.3 ms) must not pay a nap; with naps from the start,
//   1 MB took 0.48 ms.
// - After a working test, spinning continues for 50 us while that pays: on
//   shared memory the next fragment is there at once (a hit); over a socket
//   on a slow link the next bytes come a packet later and the window closes
//   empty (a miss). The window stays open while hits outnumber misses.
//   Measured on a 1 Gbit/s link, 2 ranks: with the window always open,
//   GradSync's backward ran 40-55% slower over ddpx_mpi than over Gloo (whose
//   threads sleep in epoll) and the job used 24% more CPU; with this rule,
//   13-20% and 4%, and shared-memory times unchanged.
// - Naps are 1/16 of the wait so far (the answer comes at most ~6% late):
//   at most 100 us while bytes keep coming (naps of 250 us made a 100 MB
//   shared-memory allreduce 1.5x slower), at most 300 us once nothing moved
//   for a millisecond (a peer not there yet) or spinning does not pay.
#include <chrono>

namespace ddpx::comm::detail {

class WaitPacer {
 public:
  using Clock = std::chrono::steady_clock;
  using us = std::chrono::microseconds;
  static constexpr auto kWorkingTest = std::chrono::nanoseconds(2000);
  static constexpr auto kSpinFirst = us(300);
  static constexpr auto kSpinAfterWork = us(50);
  static constexpr auto kBusyNap = us(100);
  static constexpr auto kQuietNap = us(300);
  static constexpr auto kQuiet = us(1000);

  explicit WaitPacer(Clock::time_point start) : start_(start), last_work_(start) {}

  // A test that did not complete ran from t0 to t1: how long to nap before
  // the next one (zero: test again at once).
  std::chrono::nanoseconds after_test(Clock::time_point t0, Clock::time_point t1);

  bool spinning_pays() const { return hits_ > misses_; }

 private:
  Clock::time_point start_, last_work_;
  int hits_ = 1, misses_ = 0;  // a start in favour of spinning
  bool in_window_ = false;     // a working test was seen since the last nap
};

}  // namespace ddpx::comm::detail
