// The stream hand-off of device buckets (hooks/stream_handoff.h), on a
// simulated device with asynchronous streams: work queued on a stream runs
// only when the simulator drains it, in an adversarial order (the channel's
// stream and the consumer's first, the producer's last), so work that is not
// ordered by events reads stale data, as it would on a GPU. The simulator is
// registered as the PrivateUse1 device's guard implementation, the seam
// through which c10::Stream, c10::Event and c10::StreamGuard reach CUDA.
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <deque>
#include <functional>
#include <map>
#include <thread>
#include <vector>

#include "hooks/channel.h"
#include "hooks/param_gate.h"
#include "hooks/stream_handoff.h"

namespace {

constexpr auto kSim = c10::DeviceType::PrivateUse1;

struct SimEvent {
  c10::StreamId stream = 0;
  int64_t position = 0;  // recorded when `stream` has run this many ops
};

// The simulated device: per stream a queue of ops (work, or a wait for
// another stream to reach a position), run by drain().
struct Sim {
  struct Op {
    std::function<void()> work;  // empty: a wait
    c10::StreamId wait_stream = 0;
    int64_t wait_position = 0;
  };
  std::map<c10::StreamId, std::deque<Op>> queues;
  std::map<c10::StreamId, int64_t> queued, ran;
  std::vector<std::pair<const void*, c10::StreamId>> recorded_ptrs;
  c10::StreamId next_pool = 1;

  void push(c10::StreamId s, Op op) {
    queues[s].push_back(std::move(op));
    ++queued[s];
  }
  // Runs ready ops, always from the first stream in `priority` that can run
  // one; streams not named come last. Fails on a deadlock.
  void drain(const std::vector<c10::StreamId>& priority) {
    for (;;) {
      std::vector<c10::StreamId> order = priority;
      for (auto& [s, q] : queues) {
        if (std::find(order.begin(), order.end(), s) == order.end()) order.push_back(s);
      }
      bool any_left = false, progressed = false;
      for (auto s : order) {
        auto& q = queues[s];
        if (q.empty()) continue;
        any_left = true;
        Op& op = q.front();
        if (!op.work && ran[op.wait_stream] < op.wait_position) continue;
        if (op.work) op.work();
        q.pop_front();
        ++ran[s];
        progressed = true;
        break;
      }
      if (!any_left) return;
      ASSERT_TRUE(progressed) << "the simulated streams deadlocked";
    }
  }
};

Sim& sim() {
  static Sim s;
  return s;
}

thread_local c10::StreamId current_id = 0;

struct SimGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kSim; }
  c10::Device exchangeDevice(c10::Device d) const override { return d; }
  c10::Device getDevice() const override { return c10::Device(kSim, 0); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, current_id);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, sim().next_pool++);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const auto old = current_id;
    current_id = s.id();
    return c10::Stream(c10::Stream::UNSAFE, s.device(), old);
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 2; }
  void record(void** event, const c10::Stream& s, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    if (!*event) *event = new SimEvent();
    auto* e = static_cast<SimEvent*>(*event);
    e->stream = s.id();
    e->position = sim().queued[s.id()];
  }
  void block(void* event, const c10::Stream& s) const override {
    if (!event) return;  // never recorded: nothing to wait for
    const auto* e = static_cast<const SimEvent*>(event);
    sim().push(s.id(), {{}, e->stream, e->position});
  }
  bool queryEvent(void* event) const override {
    const auto* e = static_cast<const SimEvent*>(event);
    return !e || sim().ran[e->stream] >= e->position;
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<SimEvent*>(event);
  }
  void recordDataPtrOnStream(const c10::DataPtr& p, const c10::Stream& s) const override {
    sim().recorded_ptrs.emplace_back(p.get(), s.id());
  }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, SimGuardImpl);

const c10::Device kDev(kSim, 0);

// Queues `fn` on the calling thread's current stream of the simulated device.
void enqueue(std::function<void()> fn) { sim().push(current_id, {std::move(fn)}); }

class StreamHandoff : public ::testing::Test {
 protected:
  void SetUp() override {
    sim() = Sim{};
    current_id = 0;
  }
};

// Backward writes a slot on its stream; the channel's reduction doubles it on
// the channel's stream; the consumer reads it. Drained comm-first, so only
// the events keep the order.
TEST_F(StreamHandoff, ReductionRunsAfterTheWritersAndTheConsumerAfterIt) {
  int slot = 0, seen_by_reduction = -1, seen_by_consumer = -1;
  const c10::Stream writer = ddpx::hooks::pool_stream(kDev);
  const c10::Stream comm = ddpx::hooks::pool_stream(kDev);
  const c10::Stream consumer = ddpx::hooks::current_stream(kDev);
  ASSERT_NE(writer, comm);
  ddpx::hooks::StreamFence before, done;
  {
    c10::StreamGuard g(writer);  // the hook's stream
    enqueue([&] { slot = 3; });
    before.add(ddpx::hooks::current_stream(kDev));
  }
  c10::Stream inside = consumer;
  ddpx::hooks::run_on_stream(
      comm, before, {},
      [&] {
        inside = ddpx::hooks::current_stream(kDev);
        enqueue([&] {
          seen_by_reduction = slot;
          slot *= 2;
        });
      },
      &done);
  EXPECT_EQ(inside, comm) << "the reduction must be queued on the channel's stream";
  EXPECT_EQ(ddpx::hooks::current_stream(kDev), consumer) << "the caller's stream is restored";
  done.block(consumer);
  enqueue([&] { seen_by_consumer = slot; });
  sim().drain({comm.id(), consumer.id(), writer.id()});
  EXPECT_EQ(seen_by_reduction, 3);
  EXPECT_EQ(seen_by_consumer, 6);
}

// Slots written on two streams (a model whose backward uses a side stream):
// one event per stream, and the reduction waits for both; an added stream
// already in the fence is recorded again, covering its later work.
TEST_F(StreamHandoff, EveryWriterStreamIsWaitedForAtItsLatestWork) {
  int a = 0, b = 0, sum = -1;
  const c10::Stream s1 = ddpx::hooks::pool_stream(kDev);
  const c10::Stream s2 = ddpx::hooks::pool_stream(kDev);
  const c10::Stream comm = ddpx::hooks::pool_stream(kDev);
  ddpx::hooks::StreamFence before, done;
  {
    c10::StreamGuard g(s1);
    enqueue([&] { a = 1; });
    before.add(s1);
    enqueue([&] { a = 10; });  // after the first record: covered by the second
    before.add(s1);
  }
  {
    c10::StreamGuard g(s2);
    enqueue([&] { b = 5; });
    before.add(s2);
  }
  EXPECT_EQ(before.size(), 2u);
  ddpx::hooks::run_on_stream(
      comm, before, {}, [&] { enqueue([&] { sum = a + b; }); }, &done);
  sim().drain({comm.id(), s2.id(), s1.id()});
  EXPECT_EQ(sum, 15);
}

// The consumer's stream, when it is the writer's too, is ordered after its
// own work already: the fence queues no wait on it (on a GPU, a wasted
// cudaStreamWaitEvent per bucket).
TEST_F(StreamHandoff, AStreamIsNotMadeToWaitForItself) {
  const c10::Stream s = ddpx::hooks::current_stream(kDev);
  ddpx::hooks::StreamFence f;
  enqueue([] {});
  f.add(s);
  f.block(s);
  EXPECT_EQ(sim().queues[s.id()].size(), 1u) << "no wait was queued";
}

// Storage made on another stream and used by the reduction is marked in use
// on the channel's stream, for the caching allocator.
TEST_F(StreamHandoff, StorageUsedByTheReductionIsRecordedOnItsStream) {
  const c10::Stream comm = ddpx::hooks::pool_stream(kDev);
  auto residual = torch::ones({4});
  ddpx::hooks::StreamFence before, done;
  ddpx::hooks::run_on_stream(
      comm, before, {residual.storage()}, [] {}, &done);
  ASSERT_EQ(sim().recorded_ptrs.size(), 1u);
  EXPECT_EQ(sim().recorded_ptrs[0].first, residual.storage().data_ptr().get());
  EXPECT_EQ(sim().recorded_ptrs[0].second, comm.id());
}

// Overlap modes on a device: the update of a parameter is queued (on the
// stream the worker completes the step on) when its gate opens, not run. A
// forward reading the parameter on another stream must be ordered after it:
// drained reader-first, only the gate's fence keeps the order.
TEST_F(StreamHandoff, AGateOrdersTheReadersStreamAfterTheQueuedUpdate) {
  const auto w = torch::zeros({2});  // the parameter (its identity keys the gate)
  auto gates = ddpx::hooks::Gates::make({w}, {"w"});
  int value = 1, seen = -1;
  const c10::Stream update = ddpx::hooks::pool_stream(kDev);
  const c10::Stream reader = ddpx::hooks::pool_stream(kDev);
  gates->close_all();
  {
    c10::StreamGuard g(update);
    enqueue([&] { value = 7; });
    auto queued = std::make_shared<ddpx::hooks::StreamFence>();
    queued->add(update);
    gates->open(0, queued);
  }
  {
    c10::StreamGuard g(reader);
    ddpx::hooks::wait_gate(w);  // ddpx::param_ready's work
    enqueue([&] { seen = value; });
  }
  sim().drain({reader.id(), update.id()});
  EXPECT_EQ(seen, 7) << "the forward read the parameter before its update ran";
}

// open_all (the step's end: buffers, parameters left) gives its fence only
// to gates still closed; one opened by its bucket's update keeps that one's.
TEST_F(StreamHandoff, OpenAllKeepsTheFenceOfAGateAlreadyOpen) {
  const auto a = torch::zeros({1}), b = torch::zeros({1});
  auto gates = ddpx::hooks::Gates::make({a, b}, {"a", "b"});
  const c10::Stream s1 = ddpx::hooks::pool_stream(kDev);
  const c10::Stream s2 = ddpx::hooks::pool_stream(kDev);
  gates->close_all();
  auto f1 = std::make_shared<ddpx::hooks::StreamFence>();
  auto f2 = std::make_shared<ddpx::hooks::StreamFence>();
  f1->add(s1);
  f2->add(s2);
  gates->open(0, f1);
  gates->open_all(f2);
  const auto waits_on = [&](const at::Tensor& t) {
    sim() = Sim{};  // count the waits queued on the reader's stream alone
    ddpx::hooks::wait_gate(t);
    const auto& q = sim().queues[current_id];
    EXPECT_EQ(q.size(), 1u);
    return q.empty() ? c10::StreamId(-1) : q.front().wait_stream;
  };
  EXPECT_EQ(waits_on(a), s1.id());
  EXPECT_EQ(waits_on(b), s2.id());
}

// GradSync's worker completes a step on the streams of the thread whose
// backward ended it (finish_step): captured there, installed on the worker.
TEST_F(StreamHandoff, TheWorkerQueuesOnTheStreamsOfTheThreadThatHandedItTheStep) {
  const c10::Stream trainer = ddpx::hooks::pool_stream(kDev);
  std::vector<c10::Stream> captured;
  {
    c10::StreamGuard g(trainer);
    captured = ddpx::hooks::current_streams({kDev, c10::Device(c10::kCPU), kDev});
  }
  ASSERT_EQ(captured.size(), 1u) << "one stream per device with streams";
  EXPECT_EQ(captured[0], trainer);
  // What a gate opened by the worker carries: a fence of those streams,
  // none on the CPU.
  EXPECT_EQ(ddpx::hooks::fence_current({c10::Device(c10::kCPU)}), nullptr);
  const auto fence = ddpx::hooks::fence_current({kDev, kDev});
  ASSERT_NE(fence, nullptr);
  EXPECT_EQ(fence->size(), 1u);
  c10::Stream seen = ddpx::hooks::current_stream(kDev);
  std::thread worker([&] {
    c10::MultiStreamGuard on_consumer(captured);
    seen = ddpx::hooks::current_stream(kDev);
  });
  worker.join();
  EXPECT_EQ(seen, trainer);
}

// A channel keeps one stream per device.
TEST_F(StreamHandoff, AChannelHasOneStreamPerDevice) {
  ddpx::hooks::Channel ch(nullptr);
  const c10::Device dev1(kSim, 1);
  const c10::Stream s0 = ch.stream(kDev);
  EXPECT_EQ(ch.stream(kDev), s0);
  const c10::Stream s1 = ch.stream(dev1);
  EXPECT_NE(s1, s0);
  EXPECT_EQ(s1.device(), dev1);
  EXPECT_FALSE(ddpx::hooks::has_streams(c10::Device(c10::kCPU)));
  EXPECT_TRUE(ddpx::hooks::has_streams(kDev));
}

}  // namespace
