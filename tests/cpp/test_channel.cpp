// The order of a channel's jobs (hooks/channel.h): a kOverlaps job starts
// once the kOverlaps job before it has told its last collective's start
// (comm::detail::notify_last_issue), any other job once everything before
// it has ended, and one thread (in_flight 1) runs them one at a time. The
// jobs here start no collectives: they record what they saw and tell the
// notice themselves, as allreduce_sum does after its last start.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <stdexcept>
#include <thread>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "hooks/channel.h"
#include "plugin/comm/issue_notice.h"

namespace {

using ddpx::hooks::Channel;
using Tail = Channel::Tail;
using namespace std::chrono_literals;

c10::intrusive_ptr<c10d::ProcessGroup> group() {
  return c10::make_intrusive<c10d::ProcessGroup>(/*rank=*/0, /*size=*/1);
}

// Waits up to 5 s for `flag` (a job that never sees it would otherwise hang
// the test): whether it came.
bool await(const std::atomic<bool>& flag) {
  for (int i = 0; i < 5000 && !flag.load(); ++i) std::this_thread::sleep_for(1ms);
  return flag.load();
}

TEST(Channel, TheNextOverlappingJobStartsOnceTheLastIsOnTheWire) {
  Channel ch(group(), /*in_flight=*/2);
  std::atomic<bool> issued{false}, b_started{false}, a_saw_b{false}, b_saw_issue{false};
  auto a = ch.submit(
      [&](c10d::ProcessGroup&) {
        std::this_thread::sleep_for(20ms);  // B must not start meanwhile
        issued = true;
        ddpx::comm::detail::notify_last_issue();
        a_saw_b = await(b_started);  // "the wire": A ends only after B started
      },
      Tail::kOverlaps);
  auto b = ch.submit(
      [&](c10d::ProcessGroup&) {
        b_saw_issue = issued.load();
        b_started = true;
      },
      Tail::kOverlaps);
  a.get();
  b.get();
  EXPECT_TRUE(b_saw_issue);
  EXPECT_TRUE(a_saw_b);
}

TEST(Channel, OtherJobsWaitForEveryJobBeforeThem) {
  Channel ch(group(), 2);
  std::atomic<bool> a_ended{false}, b_ended{false}, c_saw_both{false}, late_saw_a{false};
  // A is on the wire while B runs and ends; C (kSerial) still waits for A.
  auto a = ch.submit(
      [&](c10d::ProcessGroup&) {
        ddpx::comm::detail::notify_last_issue();
        await(b_ended);
        std::this_thread::sleep_for(20ms);
        a_ended = true;
      },
      Tail::kOverlaps);
  auto b = ch.submit([&](c10d::ProcessGroup&) { b_ended = true; }, Tail::kOverlaps);
  auto c = ch.submit([&](c10d::ProcessGroup&) { c_saw_both = a_ended && b_ended; });
  // A kOverlaps job right after a kSerial one waits for its end too, though
  // the serial job tells a notice (which reaches no one).
  std::atomic<bool> d_ended{false};
  auto d = ch.submit([&](c10d::ProcessGroup&) {
    ddpx::comm::detail::notify_last_issue();
    std::this_thread::sleep_for(20ms);
    d_ended = true;
  });
  auto e = ch.submit([&](c10d::ProcessGroup&) { late_saw_a = d_ended.load(); }, Tail::kOverlaps);
  for (auto* f : {&a, &b, &c, &d, &e}) f->get();
  EXPECT_TRUE(c_saw_both);
  EXPECT_TRUE(late_saw_a);
}

// Two kOverlaps jobs, the first slow to end: whether the second started
// only after the first had ended.
bool second_waited_for_the_end(int in_flight, bool notice) {
  Channel ch(group(), in_flight);
  std::atomic<bool> a_ended{false}, b_saw_end{false};
  auto a = ch.submit(
      [&](c10d::ProcessGroup&) {
        if (notice) ddpx::comm::detail::notify_last_issue();
        std::this_thread::sleep_for(20ms);
        a_ended = true;
      },
      Tail::kOverlaps);
  auto b = ch.submit([&](c10d::ProcessGroup&) { b_saw_end = a_ended.load(); }, Tail::kOverlaps);
  a.get();
  b.get();
  return b_saw_end;
}

TEST(Channel, WithoutANoticeTheEndCounts) {
  EXPECT_TRUE(second_waited_for_the_end(2, /*notice=*/false));
}

TEST(Channel, OneInFlightRunsOneAtATime) { EXPECT_TRUE(second_waited_for_the_end(1, true)); }

TEST(Channel, AFailedJobFailsItsFutureAndTheNextStillRuns) {
  Channel ch(group(), 2);
  auto a = ch.submit([](c10d::ProcessGroup&) { throw std::runtime_error("wire down"); },
                     Tail::kOverlaps);
  std::atomic<int> ran{0};
  std::vector<std::future<void>> rest;
  for (int i = 0; i < 50; ++i) {
    rest.push_back(ch.submit(
        [&](c10d::ProcessGroup&) {
          ddpx::comm::detail::notify_last_issue();
          ++ran;
        },
        i % 3 ? Tail::kOverlaps : Tail::kSerial));
  }
  EXPECT_THROW(a.get(), std::runtime_error);
  for (auto& f : rest) f.get();
  EXPECT_EQ(ran.load(), 50);
}

TEST(Channel, InFlightBelowOneIsRefused) {
  EXPECT_THROW(
      {
        try {
          Channel ch(group(), 0);
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("in_flight"), std::string::npos) << e.what();
          throw;
        }
      },
      c10::Error);
}

}  // namespace
