// The stream hand-off of device buckets (hooks/stream_handoff.h) and their
// staging through host memory (plugin/comm/host_stage.h), on a simulated device
// with asynchronous streams: work queued on a stream runs only when the
// simulator drains it, in an adversarial order (the channel's stream and the
// consumer's first, the producer's last), so work that is not ordered by
// events reads stale data, as it would on a GPU. The simulator is registered
// as the PrivateUse1 device's guard implementation, the seam through which
// c10::Stream, c10::Event and c10::StreamGuard reach CUDA.
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "hooks/channel.h"
#include "plugin/comm/host_stage.h"
#include "plugin/comm/issue_notice.h"
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
  // The order a host wait for an event (Event::synchronize) drains in.
  std::vector<c10::StreamId> host_wait_priority;

  void push(c10::StreamId s, Op op) {
    queues[s].push_back(std::move(op));
    ++queued[s];
  }
  // Runs one ready op of the first stream in `order` that has one; false
  // when none can run.
  bool run_one(const std::vector<c10::StreamId>& order) {
    for (auto s : order) {
      auto& q = queues[s];
      if (q.empty()) continue;
      Op& op = q.front();
      if (!op.work && ran[op.wait_stream] < op.wait_position) continue;
      if (op.work) op.work();
      q.pop_front();
      ++ran[s];
      return true;
    }
    return false;
  }
  // Runs ready ops, always from the first stream in `priority` that can run
  // one; streams not named come last. Fails on a deadlock.
  void drain(const std::vector<c10::StreamId>& priority) {
    for (;;) {
      std::vector<c10::StreamId> order = priority;
      bool any_left = false;
      for (auto& [s, q] : queues) {
        if (std::find(order.begin(), order.end(), s) == order.end()) order.push_back(s);
        any_left = any_left || !q.empty();
      }
      if (!any_left) return;
      ASSERT_TRUE(run_one(order)) << "the simulated streams deadlocked";
    }
  }
  // A host thread waiting for `stream` to have run `position` ops: the
  // streams of host_wait_priority run first where they can, then `stream`,
  // then the others (what `stream` waits for), one op at a time, so the
  // wait stops as soon as it is satisfied.
  void drain_until(c10::StreamId stream, int64_t position) {
    std::vector<c10::StreamId> order = host_wait_priority;
    order.push_back(stream);
    for (const auto& [s, q] : queues) {
      if (std::find(order.begin(), order.end(), s) == order.end()) order.push_back(s);
    }
    while (ran[stream] < position) {
      ASSERT_TRUE(run_one(order)) << "a host wait deadlocked";
    }
  }
};

Sim& sim() {
  static Sim s;
  return s;
}

// Held by every call into the simulator: a channel's threads queue work and
// wait for events at once (recursive: a host wait runs ops under it).
std::recursive_mutex& sim_mu() {
  static std::recursive_mutex m;
  return m;
}
using SimLock = std::lock_guard<std::recursive_mutex>;

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
    SimLock lock(sim_mu());
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
    SimLock lock(sim_mu());
    if (!*event) *event = new SimEvent();
    auto* e = static_cast<SimEvent*>(*event);
    e->stream = s.id();
    e->position = sim().queued[s.id()];
  }
  void block(void* event, const c10::Stream& s) const override {
    if (!event) return;  // never recorded: nothing to wait for
    const auto* e = static_cast<const SimEvent*>(event);
    SimLock lock(sim_mu());
    sim().push(s.id(), {{}, e->stream, e->position});
  }
  void synchronizeEvent(void* event) const override {
    SimLock lock(sim_mu());
    if (const auto* e = static_cast<const SimEvent*>(event))
      sim().drain_until(e->stream, e->position);
  }
  bool queryEvent(void* event) const override {
    const auto* e = static_cast<const SimEvent*>(event);
    SimLock lock(sim_mu());
    return !e || sim().ran[e->stream] >= e->position;
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<SimEvent*>(event);
  }
  void recordDataPtrOnStream(const c10::DataPtr& p, const c10::Stream& s) const override {
    SimLock lock(sim_mu());
    sim().recorded_ptrs.emplace_back(p.get(), s.id());
  }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, SimGuardImpl);

const c10::Device kDev(kSim, 0);

// Queues `fn` on the calling thread's current stream of the simulated device.
void enqueue(std::function<void()> fn) {
  SimLock lock(sim_mu());
  sim().push(current_id, {std::move(fn)});
}

// staged_reduce's copy on the simulated device: queued on the calling
// thread's current stream, run when the simulator drains it.
void queued_copy(const at::Tensor& dst, const at::Tensor& src) {
  enqueue([dst, src]() mutable { dst.copy_(src); });
}

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

// A reduction that fails midway (a peer gone, a codec's check): what it
// queued before failing still runs, so the storage it uses stays marked in
// use on the channel's stream and the fence covers that work, for a trainer
// that catches the error and goes on; the error reaches the caller.
TEST_F(StreamHandoff, AFailedReductionStillMarksItsStorageAndFencesItsWork) {
  const c10::Stream comm = ddpx::hooks::pool_stream(kDev);
  const c10::Stream consumer = ddpx::hooks::current_stream(kDev);
  auto bucket = torch::ones({4});
  int slot = 0, seen = -1;
  ddpx::hooks::StreamFence before, done;
  EXPECT_THROW(ddpx::hooks::run_on_stream(
                   comm, before, {bucket.storage()},
                   [&] {
                     enqueue([&] { slot = 7; });  // a copy back, queued
                     TORCH_CHECK(false, "connection reset");
                   },
                   &done),
               c10::Error);
  ASSERT_EQ(sim().recorded_ptrs.size(), 1u);
  EXPECT_EQ(sim().recorded_ptrs[0].second, comm.id());
  done.block(consumer);
  enqueue([&] { seen = slot; });  // the next backward's write to the slot
  sim().drain({consumer.id(), comm.id()});
  EXPECT_EQ(seen, 7) << "the consumer ran before the failed reduction's queued work";
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

// ---- staging through host memory (plugin/comm/host_stage.h) -----------------------------

// Chunked staging of a "device" bucket (a CPU tensor whose reads and writes
// the simulator queues on streams): every chunk's copy out is queued before
// the first reduction starts, each chunk's reduction starts only after its
// own copy out ran, at most `in_flight` are started and not waited for, and
// a chunk's copy back is queued only after its wait (the reduction writes
// the host chunk when it completes, at the wait here); the bucket the
// consumer reads is the reduced one, also when the host buffer is reused by
// a second reduction. Streams drained adversarially: the consumer and the
// channel before the writer, and a host wait runs the other streams first.
TEST_F(StreamHandoff, StagedChunksArePipelinedAndOrderedByTheirEvents) {
  // (chunk 9: the tail of 1 element, under 1/8 of a chunk, rides with the
  // first chunk)
  for (const int in_flight : {1, 2, 3}) {
    for (const auto& c : std::vector<std::pair<int64_t, int64_t>>{
             {3, 4}, {4, 3}, {9, 1}, {10, 1}, {64, 1}}) {
      const int64_t chunk = c.first, want_chunks = c.second;
      sim() = Sim{};
      const int64_t n = 10, chunks = ddpx::comm::detail::stage_chunk_count(n, chunk);
      EXPECT_EQ(chunks, want_chunks) << "chunk " << chunk;
      const c10::Stream writer = ddpx::hooks::pool_stream(kDev);
      const c10::Stream comm = ddpx::hooks::pool_stream(kDev);
      const c10::Stream consumer = ddpx::hooks::current_stream(kDev);
      sim().host_wait_priority = {consumer.id(), writer.id()};
      at::Tensor dev = torch::zeros({n}), host = torch::full({n + 5}, -1.0);
      std::vector<std::string> log;
      // Copies run when the simulator drains the stream they were queued on.
      const ddpx::comm::detail::CopyFn copy = [&](const at::Tensor& dst, const at::Tensor& src) {
        const bool out = dst.data_ptr() >= host.data_ptr() &&
                         dst.data_ptr() < static_cast<char*>(host.data_ptr()) + host.nbytes();
        log.push_back(std::string(out ? "queue out " : "queue back ") +
                      std::to_string(src.numel()));
        queued_copy(dst, src);
      };
      auto len = [&](int64_t k) { return std::to_string(k + 1 < chunks ? chunk : n - k * chunk); };
      for (int round = 1; round <= 2; ++round) {
        ddpx::hooks::StreamFence before, done;
        {
          c10::StreamGuard g(writer);  // backward's stream fills the bucket
          enqueue([&dev, round] { dev.copy_(torch::arange(10.0) + 100 * round); });
          before.add(writer);
        }
        std::vector<at::Tensor> seen;
        log.clear();
        ddpx::hooks::run_on_stream(
            comm, before, {},
            [&] {
              ddpx::comm::detail::staged_reduce(
                  comm, dev, host, chunk, copy,
                  [&](at::Tensor& h) -> std::function<void()> {
                    log.push_back("start " + std::to_string(h.numel()));
                    seen.push_back(h.clone());
                    return [&log, h]() mutable {
                      log.push_back("wait " + std::to_string(h.numel()));
                      h.mul_(2);
                    };
                  },
                  in_flight);
            },
            &done);
        at::Tensor read;
        done.block(consumer);
        enqueue([&] { read = dev.clone(); });
        sim().drain({consumer.id(), comm.id(), writer.id()});
        const at::Tensor want = torch::arange(10.0) + 100 * round;
        ASSERT_EQ(static_cast<int64_t>(seen.size()), chunks);
        EXPECT_TRUE(torch::equal(torch::cat(seen), want)) << "a chunk reduced before its copy out";
        EXPECT_TRUE(torch::equal(read, want * 2))
            << "chunk " << chunk << ", in flight " << in_flight << ", round " << round;
        // Every copy out queued before the first start; then `in_flight`
        // started ahead of the oldest's wait, each copy back right after it.
        std::vector<std::string> order;
        for (int64_t k = 0; k < chunks; ++k) order.push_back("queue out " + len(k));
        int64_t waited = 0;
        auto finish = [&] {
          order.push_back("wait " + len(waited));
          order.push_back("queue back " + len(waited));
          ++waited;
        };
        for (int64_t k = 0; k < chunks; ++k) {
          order.push_back("start " + len(k));
          if (k + 1 - waited >= in_flight) finish();
        }
        while (waited < chunks) finish();
        EXPECT_EQ(log, order) << "chunk " << chunk << ", in flight " << in_flight;
      }
    }
  }
}

// A failed chunk: the reductions already started are waited for (they write
// into the host buffer) before the error leaves, and no later chunk starts.
TEST_F(StreamHandoff, StagedChunkErrorWaitsForTheStartedOnes) {
  const c10::Stream comm = ddpx::hooks::pool_stream(kDev);
  c10::StreamGuard g(comm);
  at::Tensor dev = torch::arange(8.0), host = torch::zeros({8});
  std::vector<std::string> log;
  const ddpx::comm::detail::CopyFn copy = queued_copy;
  EXPECT_THROW(ddpx::comm::detail::staged_reduce(
                   comm, dev, host, 2, copy,
                   [&](at::Tensor& h) -> std::function<void()> {
                     const std::string k = std::to_string(log.size());
                     log.push_back("start " + k);
                     return [&log, k] {
                       log.push_back("wait " + k);
                       TORCH_CHECK(k != "0", "chunk 0 failed");
                     };
                   },
                   /*in_flight=*/2),
               c10::Error);
  EXPECT_EQ(log, (std::vector<std::string>{"start 0", "start 1", "wait 0", "wait 1"}));
  sim().drain({comm.id()});
}

// The thread's staging buffer used on one stream, then on another (a user
// thread calling compressed_allreduce under two streams): the host never
// waited for the first stream's copies back out of it, so the second
// stream's copies into it must wait for them. Host waits run the second
// stream first, as a GPU may.
TEST_F(StreamHandoff, AHostBufferUsedOnAnotherStreamWaitsForItsLastUse) {
  std::thread fresh([] {  // (a thread of its own: a fresh thread_host_buffer)
    const c10::Stream a = ddpx::hooks::pool_stream(kDev);
    const c10::Stream b = ddpx::hooks::pool_stream(kDev);
    sim().host_wait_priority = {b.id()};
    const ddpx::comm::detail::CopyFn copy = queued_copy;
    const at::Tensor want_a = torch::arange(6.0) * 2, want_b = (torch::arange(6.0) + 100) * 2;
    at::Tensor dev_a = torch::arange(6.0), dev_b = torch::arange(6.0) + 100;
    for (const auto& [stream, dev] : {std::pair{a, dev_a}, std::pair{b, dev_b}}) {
      c10::StreamGuard g(stream);
      ddpx::comm::detail::staged_reduce(
          stream, dev, ddpx::comm::detail::thread_host_buffer(dev, stream), 4, copy,
          [](at::Tensor& h) -> std::function<void()> { return [h]() mutable { h.mul_(2); }; });
    }
    sim().drain({b.id(), a.id()});
    EXPECT_TRUE(torch::equal(dev_a, want_a)) << dev_a;
    EXPECT_TRUE(torch::equal(dev_b, want_b)) << dev_b;
  });
  fresh.join();
}

// GradSync's two buckets in flight on one channel (hooks/channel.h,
// calls_in_flight 2), as on a GPU: each a staged reduction on the channel's
// one stream of the device, from its own channel thread and host buffer;
// the second starts once the first has started its last chunk (the notice
// allreduce_sum gives), and here starts all of its own while that chunk is
// still on the wire (a host buffer shared by the two would have been
// overwritten under it). Their copies interleave on the stream, host waits
// drain it adversarially, and each bucket the consumer reads is its own,
// reduced. Two rounds: the
// threads' host buffers are reused, by whichever thread takes a bucket.
TEST_F(StreamHandoff, TwoStagedBucketsInFlightShareTheChannelStream) {
  namespace detail = ddpx::comm::detail;
  ddpx::hooks::Channel ch(c10::make_intrusive<c10d::ProcessGroup>(0, 1), /*in_flight=*/2);
  const c10::Stream comm = ch.stream(kDev);
  const c10::Stream writer = ddpx::hooks::pool_stream(kDev);
  const c10::Stream consumer = ddpx::hooks::current_stream(kDev);
  {
    SimLock lock(sim_mu());
    sim().host_wait_priority = {consumer.id(), writer.id()};
  }
  const detail::CopyFn copy = queued_copy;
  for (int round = 1; round <= 2; ++round) {
    std::vector<at::Tensor> dev{torch::zeros({10}), torch::zeros({13})}, want;
    ddpx::hooks::StreamFence before;
    {
      c10::StreamGuard g(writer);  // backward fills both buckets
      for (size_t b = 0; b < dev.size(); ++b) {
        want.push_back(torch::arange(static_cast<double>(dev[b].numel())) + 100 * round +
                       1000 * static_cast<double>(b));
        enqueue([d = dev[b], w = want[b]]() mutable { d.copy_(w); });
      }
      before.add(writer);
    }
    std::mutex log_mu;
    std::vector<int> starts;  // the bucket of each chunk started, in order
    std::atomic<bool> second_all_started{false};
    bool first_saw_second = false;
    std::vector<ddpx::hooks::StreamFence> done(2);
    std::vector<std::future<void>> jobs;
    for (int b = 0; b < 2; ++b) {
      jobs.push_back(ch.submit(
          [&, b](c10d::ProcessGroup&) {
            const int64_t chunk = 3, chunks = detail::stage_chunk_count(dev[b].numel(), chunk);
            int64_t started = 0;
            const detail::StartReduceFn start = [&](at::Tensor& h) -> std::function<void()> {
              {
                std::lock_guard<std::mutex> lock(log_mu);
                starts.push_back(b);
              }
              const bool last = ++started == chunks;
              if (last) detail::notify_last_issue();
              if (b == 1 && last) second_all_started = true;
              return [&, h, last]() mutable {
                if (b == 0 && last) {  // on the wire until the next bucket's are
                  for (int i = 0; i < 5000 && !second_all_started; ++i) {
                    std::this_thread::sleep_for(std::chrono::milliseconds(1));
                  }
                  first_saw_second = second_all_started;
                }
                h.mul_(2);
              };
            };
            ddpx::hooks::run_on_stream(
                comm, before, {},
                [&] {
                  detail::staged_reduce(comm, dev[b], detail::thread_host_buffer(dev[b], comm),
                                        chunk, copy, start);
                },
                &done[b]);
          },
          ddpx::hooks::Channel::Tail::kOverlaps));
    }
    for (auto& j : jobs) j.get();
    std::vector<at::Tensor> read(2);
    for (int b = 0; b < 2; ++b) {
      done[b].block(consumer);
      enqueue([&read, &dev, b] { read[b] = dev[b].clone(); });
    }
    {
      SimLock lock(sim_mu());
      sim().drain({consumer.id(), comm.id(), writer.id()});
    }
    EXPECT_TRUE(first_saw_second) << "round " << round << ": the buckets were not both in flight";
    EXPECT_EQ(starts, (std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1, 1})) << "round " << round;
    for (int b = 0; b < 2; ++b) {
      EXPECT_TRUE(torch::equal(read[b], want[b] * 2)) << "round " << round << ", bucket " << b
                                                      << ": " << read[b];
    }
  }
}

}  // namespace
