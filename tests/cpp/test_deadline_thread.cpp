// DeadlineThread (the scheduling half of ddpx_mpi's watchdog): every armed
// deadline that passes fires, once, and on time; a disarmed one never does.
#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "plugin/comm/deadline_thread.h"

namespace {

using ddpx::comm::detail::DeadlineThread;
using ms = std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// Records which keys fired (from the action, off the lock) and when.
struct Fired {
  std::mutex mu;
  std::vector<std::pair<void*, Clock::time_point>> keys;
  std::atomic<int> under_lock{0};

  DeadlineThread::Expire expire() {
    return [this](void* key, ms) -> std::function<void()> {
      ++under_lock;
      return [this, key] {
        std::lock_guard<std::mutex> lock(mu);
        keys.emplace_back(key, Clock::now());
      };
    };
  }
  bool wait_for(void* key, ms limit) {
    const auto end = Clock::now() + limit;
    while (Clock::now() < end) {
      {
        std::lock_guard<std::mutex> lock(mu);
        for (auto& [k, t] : keys) {
          if (k == key) return true;
        }
      }
      std::this_thread::sleep_for(ms(1));
    }
    return false;
  }
  size_t count() {
    std::lock_guard<std::mutex> lock(mu);
    return keys.size();
  }
};

int a, b, c;  // keys: only their addresses matter

TEST(DeadlineThread, FiresAfterTheTimeoutAndOnlyOnce) {
  Fired fired;
  DeadlineThread dt("ddpx_test_dl", fired.expire());
  const auto t0 = Clock::now();
  dt.arm(&a, ms(30));
  ASSERT_TRUE(fired.wait_for(&a, ms(5000)));
  EXPECT_GE(fired.keys[0].second - t0, ms(30));
  std::this_thread::sleep_for(ms(60));
  EXPECT_EQ(fired.count(), 1u);
}

TEST(DeadlineThread, DisarmedNeverFires) {
  Fired fired;
  DeadlineThread dt("ddpx_test_dl", fired.expire());
  dt.arm(&a, ms(20));
  dt.disarm(&a);
  dt.arm(&b, ms(40));
  ASSERT_TRUE(fired.wait_for(&b, ms(5000)));
  std::this_thread::sleep_for(ms(40));
  EXPECT_EQ(fired.count(), 1u);
  EXPECT_EQ(fired.under_lock.load(), 1);
}

// The bug behind issue 22's hung Future.wait (np 2, under load): a key armed
// and disarmed before the thread looked, the thread woken by that arm finding
// nothing armed, then a later deadline. The thread kept the dead deadline as
// its wake-up time but slept with none, and arm() saw nothing earlier to wake
// it for: the later deadline never fired.
// The thread runs on the test's one CPU under SCHED_IDLE, so it cannot run
// between arm(b) and disarm(b) (on a free core it usually did, which hid the
// bug); it runs as soon as the test thread sleeps.
TEST(DeadlineThread, ALaterDeadlineFiresAfterAnArmedAndDisarmedOne) {
  cpu_set_t saved, one;
  ASSERT_EQ(sched_getaffinity(0, sizeof(saved), &saved), 0);
  CPU_ZERO(&one);
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &saved)) {
      CPU_SET(cpu, &one);
      break;
    }
  }
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  const sched_param normal{0};
  for (int round = 0; round < 100; ++round) {
    Fired fired;
    DeadlineThread dt("ddpx_test_dl", fired.expire());
    // The thread starts at the first arm and inherits this thread's policy.
    ASSERT_EQ(sched_setscheduler(0, SCHED_IDLE, &normal), 0);
    dt.arm(&a, ms(1));
    ASSERT_EQ(sched_setscheduler(0, SCHED_OTHER, &normal), 0);
    ASSERT_TRUE(fired.wait_for(&a, ms(5000))) << "round " << round;
    std::this_thread::sleep_for(ms(2));  // the thread now waits with nothing armed
    dt.arm(&b, ms(5));
    dt.disarm(&b);
    std::this_thread::sleep_for(ms(1));  // the thread wakes, finds nothing armed
    dt.arm(&c, ms(10));
    ASSERT_TRUE(fired.wait_for(&c, ms(2000))) << "round " << round << ": c never fired";
  }
  sched_setaffinity(0, sizeof(saved), &saved);
}

// An earlier deadline armed while the thread waits for a later one wakes it.
TEST(DeadlineThread, AnEarlierDeadlineOvertakes) {
  Fired fired;
  DeadlineThread dt("ddpx_test_dl", fired.expire());
  dt.arm(&a, ms(60000));
  const auto t0 = Clock::now();
  dt.arm(&b, ms(20));
  ASSERT_TRUE(fired.wait_for(&b, ms(5000)));
  EXPECT_LT(Clock::now() - t0, ms(4000));
  dt.disarm(&a);
}

// Arming from many threads while deadlines fire: each key fires exactly once.
TEST(DeadlineThread, ManyArmersEachKeyOnce) {
  Fired fired;
  DeadlineThread dt("ddpx_test_dl", fired.expire());
  constexpr int kThreads = 4, kKeys = 200;
  std::vector<char> keys(kThreads * kKeys);
  std::vector<std::thread> armers;
  for (int t = 0; t < kThreads; ++t) {
    armers.emplace_back([&, t] {
      for (int i = 0; i < kKeys; ++i) {
        void* key = &keys[t * kKeys + i];
        dt.arm(key, ms(1 + (i * 7) % 13));
        if (i % 3 == 0) dt.disarm(key);  // a third never fires (unless it already did)
      }
    });
  }
  for (auto& th : armers) th.join();
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kKeys; ++i) {
      if (i % 3 == 0) continue;
      ASSERT_TRUE(fired.wait_for(&keys[t * kKeys + i], ms(5000))) << t << "/" << i;
    }
  }
  std::lock_guard<std::mutex> lock(fired.mu);
  std::vector<void*> seen;
  for (auto& [k, tp] : fired.keys) seen.push_back(k);
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end()) << "a key fired twice";
}

}  // namespace
