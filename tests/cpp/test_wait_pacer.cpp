// WaitPacer (ddpx_mpi's await_request) driven by a made-up clock: when a
// pending request is tested again at once, and when after a nap.
#include <gtest/gtest.h>

#include <functional>

#include "plugin/comm/wait_pacer.h"

namespace {

using ddpx::comm::detail::WaitPacer;
using ns = std::chrono::nanoseconds;
using us = std::chrono::microseconds;

constexpr ns kIdleTest{300};     // an MPI_Test that moved nothing
constexpr ns kWorkingTest{5000};  // one that copied a fragment

struct Wait {
  ns spun{0};      // time in tests not followed by a nap: a core burnt
  ns napped{0};
  ns longest_nap{0};
  int naps_right_after_work = 0;  // a working test, then a nap at once
};

// Runs the pacer for `total` of made-up time; `works(t)` says whether a
// test started at t (from the start) moves bytes.
Wait simulate(ns total, const std::function<bool(ns)>& works) {
  const WaitPacer::Clock::time_point start{};
  WaitPacer pacer(start);
  Wait w;
  ns t{0};
  while (t < total) {
    const bool working = works(t);
    const ns took = working ? kWorkingTest : kIdleTest;
    const ns nap = pacer.after_test(start + t, start + t + took);
    t += took;
    if (nap.count() == 0) {
      w.spun += took;
      continue;
    }
    if (working) ++w.naps_right_after_work;
    w.napped += nap;
    w.longest_nap = std::max(w.longest_nap, nap);
    t += nap;
  }
  return w;
}

TEST(WaitPacer, SharedMemoryKeepsSpinning) {
  // Every test copies a fragment: a transfer as fast as a blocking call.
  const auto w = simulate(std::chrono::milliseconds(20), [](ns) { return true; });
  EXPECT_EQ(w.napped.count(), 0);
}

TEST(WaitPacer, SpinsFirstThenNapsLongerTheLongerItWaits) {
  // No peer yet: nothing moves.
  const auto w = simulate(std::chrono::milliseconds(20), [](ns) { return false; });
  EXPECT_GE(w.spun, WaitPacer::kSpinFirst - kIdleTest);
  EXPECT_LT(w.spun, WaitPacer::kSpinFirst + us(5));
  EXPECT_EQ(w.longest_nap, WaitPacer::kQuietNap);
}

// Bytes that arrive every `period`, `per_arrival` fragments at a time, and
// wait (in a socket or a shared-memory queue) until a test takes them: a
// test works when a fragment is pending, and takes one.
std::function<bool(ns)> arrivals(ns period, int per_arrival) {
  return [period, per_arrival, taken = int64_t{0}](ns t) mutable {
    const int64_t arrived = (t / period + 1) * per_arrival;
    if (taken >= arrived) return false;
    ++taken;
    return true;
  };
}

TEST(WaitPacer, ASlowSocketIsNotSpunOn) {
  // A packet every 500 us (a 1 Gbit/s link).
  const auto total = std::chrono::milliseconds(100);
  const auto w = simulate(total, arrivals(us(500), 1));
  // With the window always open: 50 us of every 500 spun (10%), plus the
  // first 300 us.
  EXPECT_LT(w.spun, total / 100 + WaitPacer::kSpinFirst);
  EXPECT_GT(w.naps_right_after_work, 150);
  // Work keeps coming, but spinning does not pay: the quiet naps.
  EXPECT_EQ(w.longest_nap, WaitPacer::kQuietNap);
}

TEST(WaitPacer, BytesAfterAQuietSpellSpinAgain) {
  // 5 ms with no peer, then shared-memory copies until the end: the wait
  // caught up at once and spins through the transfer again.
  const auto quiet = std::chrono::milliseconds(5);
  const WaitPacer::Clock::time_point start{};
  WaitPacer pacer(start);
  ns t{0};
  while (t < quiet) t += kIdleTest + pacer.after_test(start + t, start + t + kIdleTest);
  EXPECT_TRUE(pacer.spinning_pays());  // no window closed empty: none opened
  int naps = 0;
  for (int i = 0; i < 1000; ++i, t += kWorkingTest) {
    if (pacer.after_test(start + t, start + t + kWorkingTest).count() != 0) ++naps;
  }
  EXPECT_EQ(naps, 0);
}

TEST(WaitPacer, NapsWhileBytesComeStayShort) {
  // Four fragments every 200 us, as from a shared-memory peer between
  // rounds: spinning pays (the fragments after the first are there at once),
  // and the naps between bursts stay at most the busy cap.
  const auto w = simulate(std::chrono::milliseconds(20), arrivals(us(200), 4));
  EXPECT_GT(w.napped.count(), 0);
  EXPECT_LE(w.longest_nap, WaitPacer::kBusyNap);
  EXPECT_EQ(w.naps_right_after_work, 0);
}

}  // namespace
