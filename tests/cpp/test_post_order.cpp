// PostOrder (issue 64): the collectives that Future callbacks issue reach
// MPI in an order set by the works' own order, whatever the thread timing.
// Each test plays the threads of one rank in a chosen interleaving and
// checks the order calls are released to the worker.
#include <gtest/gtest.h>
#include <time.h>

#include <chrono>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "plugin/comm/post_order.h"

namespace {

using ddpx::comm::detail::PostOrder;
using ChainPtr = std::shared_ptr<PostOrder::Chain>;

// One rank's calls: each is a Work (its address is the key), posted by the
// caller or by a chain, released in an order this records.
struct Rank {
  std::shared_ptr<PostOrder> order = PostOrder::create();
  std::mutex mu;
  std::vector<std::string> released;
  std::vector<uint64_t> numbers;
  // Key storage: a call's key is the address of its name.
  std::vector<std::unique_ptr<std::string>> names;
  std::vector<ChainPtr> issued_by;

  const void* key(const std::string& name) {
    for (const auto& n : names) {
      if (*n == name) return n.get();
    }
    names.push_back(std::make_unique<std::string>(name));
    issued_by.emplace_back();
    return names.back().get();
  }
  ChainPtr* issuer(const std::string& name) {
    key(name);
    for (size_t i = 0; i < names.size(); ++i) {
      if (*names[i] == name) return &issued_by[i];
    }
    return nullptr;
  }
  void post(const std::string& name) {
    ChainPtr* by = issuer(name);
    order->post(
        key(name),
        [this, name](uint64_t n) {
          std::lock_guard<std::mutex> lock(mu);
          released.push_back(name);
          numbers.push_back(n);
        },
        by);
  }
  ChainPtr open(const std::string& name) { return order->open_chain(key(name)); }
  // `name` is done (its callbacks, if `own`, returned).
  void finish(const std::string& name, const ChainPtr& own = nullptr) {
    order->finished(own, *issuer(name));
  }
  std::vector<std::string> seen() {
    std::lock_guard<std::mutex> lock(mu);
    return released;
  }
};

// Runs `fn` as `chain`'s callbacks on a thread of its own (as the completion
// queue does) and waits for it.
void run_chain(const ChainPtr& chain, const std::function<void()>& fn) {
  std::thread([&] {
    PostOrder::Running running(chain);
    fn();
  }).join();
}

using Names = std::vector<std::string>;

TEST(PostOrder, NothingHeldGoesAtOnceInOrder) {
  Rank r;
  r.post("a");
  r.post("b");
  r.finish("a");
  r.post("c");
  EXPECT_EQ(r.seen(), (Names{"a", "b", "c"}));
  EXPECT_EQ(r.numbers, (std::vector<uint64_t>{0, 1, 2}));
  EXPECT_EQ(r.order->held(), 0u);
}

// PowerSGD's shape: bucket k's all-reduce A_k from the caller, then P_k and
// Q_k from its callbacks. Two timings of the caller against the callbacks
// (A1 issued before or after bucket 0's callbacks ran) release one order.
Names powersgd_two_buckets(bool caller_first) {
  Rank r;
  r.post("A0");
  auto c0 = r.open("A0");
  auto issue_a1 = [&] {
    r.post("A1");
    return r.open("A1");
  };
  ChainPtr c1;
  if (caller_first) c1 = issue_a1();
  run_chain(c0, [&] {
    r.post("P0");
    if (!caller_first) {
      // The caller issues A1 from its own thread while this callback waits.
      std::thread([&] { c1 = issue_a1(); }).join();
    }
    r.finish("P0");
    r.post("Q0");
    r.finish("Q0");
    r.finish("A0", c0);
  });
  EXPECT_EQ(r.order->held(), 0u);
  run_chain(c1, [&] {
    r.post("P1");
    r.finish("P1");
    r.post("Q1");
    r.finish("Q1");
    r.finish("A1", c1);
  });
  return r.seen();
}

TEST(PostOrder, CallbacksIssueAheadOfLaterCallsWhateverTheTiming) {
  const Names want{"A0", "P0", "Q0", "A1", "P1", "Q1"};
  EXPECT_EQ(powersgd_two_buckets(/*caller_first=*/true), want);
  EXPECT_EQ(powersgd_two_buckets(/*caller_first=*/false), want);
}

TEST(PostOrder, ACallbackOfACallbacksCollectiveNests) {
  Rank r;
  r.post("W");
  auto cw = r.open("W");
  r.post("later");  // held behind W's callbacks
  run_chain(cw, [&] {
    r.post("X");
    auto cx = r.open("X");
    r.post("X2");  // W's, after X's callbacks
    run_chain(cx, [&] {
      r.post("Y");  // X's callback: ahead of what W issued after taking X's Future
      r.finish("Y");
      r.finish("X", cx);
    });
    r.finish("X2");
    EXPECT_EQ(r.order->held(), 1u);  // "later"
    r.finish("W", cw);
  });
  EXPECT_EQ(r.seen(), (Names{"W", "X", "Y", "X2", "later"}));
}

TEST(PostOrder, ACallbackThatWaitsOnAHeldCallYieldsToIt) {
  Rank r;
  r.post("W0");
  auto c0 = r.open("W0");
  r.post("W1");
  auto c1 = r.open("W1");
  r.post("W2");
  EXPECT_EQ(r.order->held(), 2u);
  run_chain(c0, [&] {
    r.order->waiting_on(r.key("W1"));  // Work::wait on W1 from W0's callback
    EXPECT_EQ(r.seen(), (Names{"W0", "W1"}));
    r.post("C0");  // after W1 now, still ahead of W1's callbacks and W2
    r.finish("C0");
    r.finish("W0", c0);
  });
  run_chain(c1, [&] { r.finish("W1", c1); });
  EXPECT_EQ(r.seen(), (Names{"W0", "W1", "C0", "W2"}));
}

TEST(PostOrder, TakingAHeldCallsFutureFromACallbackYieldsToIt) {
  Rank r;
  r.post("W0");
  auto c0 = r.open("W0");
  r.post("W1");
  ChainPtr c1;
  run_chain(c0, [&] {
    // W1's Future, taken here: W1 goes first, and its callbacks' place is
    // here, ahead of what this callback issues next.
    c1 = r.open("W1");
    r.post("C0");
    EXPECT_EQ(r.seen(), (Names{"W0", "W1"}));
    r.finish("W0", c0);
  });
  r.post("W2");
  run_chain(c1, [&] {
    r.post("C1");
    r.finish("C1");
    r.finish("W1", c1);
  });
  EXPECT_EQ(r.seen(), (Names{"W0", "W1", "C1", "C0", "W2"}));
}

int64_t thread_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// Step 3: a callback blocked where the order cannot see (a Future taken
// elsewhere) on a call held behind it lets it go; one that computes does not.
TEST(PostOrder, ACallbackBlockedOutOfSightYieldsAndAComputingOneDoesNot) {
  Rank r;
  r.post("W0");
  auto c0 = r.open("W0");
  r.post("W1");
  std::promise<void> w1_released;
  run_chain(c0, [&] {
    // Computing: 3 x kTick of this thread's CPU time with W1 held behind.
    const int64_t until = thread_cpu_ns() + 3 * std::chrono::nanoseconds(PostOrder::kTick).count();
    volatile double x = 0;
    while (thread_cpu_ns() < until) x = x + 1.0;
    EXPECT_EQ(r.order->held(), 1u);
    // Blocked: W1 goes (within the ticks of step 3; 30 s is only a bound).
    const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (r.order->held() != 0 && std::chrono::steady_clock::now() < limit) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_EQ(r.seen(), (Names{"W0", "W1"}));
    r.post("C0");  // after the yield: behind what was held
    r.finish("W0", c0);
  });
  EXPECT_EQ(r.seen(), (Names{"W0", "W1", "C0"}));
}

// A callback with a collective of its own in flight is waiting for it, not
// for something held: step 3 leaves it alone.
TEST(PostOrder, ACallbackWaitingOnItsOwnCollectiveHoldsItsPlace) {
  Rank r;
  r.post("W0");
  auto c0 = r.open("W0");
  r.post("W1");
  run_chain(c0, [&] {
    r.post("P0");
    std::this_thread::sleep_for(PostOrder::kTick * (PostOrder::kIdleTicks + 2));
    EXPECT_EQ(r.seen(), (Names{"W0", "P0"}));
    r.finish("P0");
    r.post("Q0");
    r.finish("Q0");
    r.finish("W0", c0);
  });
  EXPECT_EQ(r.seen(), (Names{"W0", "P0", "Q0", "W1"}));
}

TEST(PostOrder, TasksWithoutAWorkKeepTheirPlaceUnnumbered) {
  Rank r;
  r.post("W0");
  auto c0 = r.open("W0");
  std::vector<std::string> seen;
  r.order->post(
      nullptr, [&](uint64_t) { seen.push_back("free"); }, nullptr);
  EXPECT_TRUE(seen.empty());  // behind W0's callbacks, as a collective would be
  r.finish("W0", c0);
  EXPECT_EQ(seen, (Names{"free"}));
  r.post("W1");
  EXPECT_EQ(r.numbers, (std::vector<uint64_t>{0, 1}));
}

}  // namespace
