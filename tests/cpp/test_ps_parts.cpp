// The parameter server's parts that need no MPI (ddpx/ps.h): the shard
// layout, the consistency gate driven by simulated workers, the staleness
// record, and the point-to-point codec messages.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ddpx/ps.h>
#include <gtest/gtest.h>

#include <queue>
#include <random>

#include "plugin/comm/codec_message.h"
#include "plugin/ps/gate.h"
#include "plugin/ps/layout.h"
#include "mpi_test_util.h"

using ddpx::comm::MessageCodec;
using ddpx::ps::Consistency;
using ddpx::ps::Staleness;
using ddpx::ps::detail::Decision;
using ddpx::ps::detail::Gate;
using ddpx::ps::detail::Layout;
using ddpx::ps::detail::Ticket;

namespace {

using ddpx::test::error_of;

TEST(PsLayout, BalancedAndSplitsTensors) {
  const std::vector<int64_t> numels = {65, 13, 39, 3};  // 120 elements
  for (int k : {1, 2, 3, 7}) {
    const Layout l = Layout::plan(numels, k);
    ASSERT_EQ(l.total, 120);
    std::vector<int> covered(120, 0);
    std::vector<int64_t> starts = {0, 65, 78, 117};
    for (int s = 0; s < k; ++s) {
      int64_t n = 0;
      for (const auto& sg : l.shards[s]) {
        for (int64_t i = 0; i < sg.numel; ++i) covered[starts[sg.param] + sg.offset + i] += 1;
        n += sg.numel;
      }
      EXPECT_EQ(n, l.shard_numel[s]);
      EXPECT_LE(std::abs(n - 120 / k), 1) << "server " << s << " of " << k;
    }
    for (int c : covered) ASSERT_EQ(c, 1);  // every element on exactly one server
  }
  // With 2 servers the cut at 60 splits the first tensor.
  const Layout l = Layout::plan(numels, 2);
  EXPECT_EQ(l.shards[0].size(), 1u);
  EXPECT_EQ(l.shards[1][0].param, 0);
  EXPECT_EQ(l.shards[1][0].offset, 60);
  EXPECT_EQ(l.shards[1][0].numel, 5);
}

TEST(PsConsistency, ParsesAndRefuses) {
  EXPECT_EQ(Consistency::parse("async").str(), "async");
  EXPECT_EQ(Consistency::parse("ssp:3").bound, 3);
  EXPECT_EQ(Consistency::parse("sync").quorum, 0);
  EXPECT_EQ(Consistency::parse("sync:2").quorum, 2);
  for (const char* bad : {"", "asynch", "ssp", "ssp:", "ssp:-1", "ssp:x", "sync:0", "sync:2x"}) {
    EXPECT_NE(error_of([&] { Consistency::parse(bad); }).find("unknown consistency"),
              std::string::npos)
        << bad;
  }
}

TEST(PsStaleness, Percentiles) {
  Staleness s;
  for (int i = 0; i < 98; ++i) s.add(1);
  s.add(5);
  s.add(9);
  EXPECT_EQ(s.total(), 100);
  EXPECT_DOUBLE_EQ(s.mean(), (98 + 5 + 9) / 100.0);
  EXPECT_EQ(s.percentile(0.5), 1);
  EXPECT_EQ(s.percentile(0.99), 5);
  EXPECT_EQ(s.max(), 9);
  Staleness t;
  t.add(0, 10);
  t.merge(s);
  EXPECT_EQ(t.total(), 110);
  EXPECT_EQ(t.counts[0], 10);
}

// N simulated workers with random step times drive a Gate as the server
// does with pulls after pushes: a push is offered when a worker's step ends;
// each applied or dropped push is done with, and its worker starts its next
// step with the version of that moment once the gate lets it (ssp holds a
// worker that is too far ahead). Returns the staleness of every applied push
// and the largest lead of a starting worker over the slowest live one,
// counted here, apart from the gate.
struct SimResult {
  Staleness staleness;
  int64_t applied = 0, dropped = 0, updates = 0;
  int64_t max_lead = 0;
};
SimResult simulate(Consistency c, int workers, int steps, uint32_t seed, bool deterministic,
                   int slow_factor) {
  Gate gate(c, workers, deterministic);
  std::mt19937 rng(seed);
  using Event = std::pair<double, int>;  // (time a step ends, worker)
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events;
  std::vector<int64_t> base(workers, 0), seq(workers, 0), done(workers, 0);
  std::vector<bool> waiting(workers, false), live(workers, true);
  auto step_time = [&](int w) { return (1 + rng() % 100) * (w == 0 ? slow_factor : 1) / 100.0; };
  for (int w = 0; w < workers; ++w) {
    gate.gave(w, 0);
    events.push({step_time(w), w});
  }
  int64_t version = 0, id = 0;
  SimResult r;
  auto done_with = [&](const Ticket& tk) {
    gate.finished(tk.worker);
    ++done[tk.worker];
    if (seq[tk.worker] < steps) {
      waiting[tk.worker] = true;
    } else {
      gate.gone(tk.worker);
      live[tk.worker] = false;
    }
  };
  while (!events.empty()) {
    const auto [t, w] = events.top();
    events.pop();
    gate.offer(Ticket{w, seq[w]++, base[w], id++});
    while (auto d = gate.next(version)) {
      for (const auto& tk : d->drop) {
        ++r.dropped;
        done_with(tk);
      }
      if (d->apply.empty()) continue;
      for (const auto& tk : d->apply) r.staleness.add(version - tk.base);
      r.applied += static_cast<int64_t>(d->apply.size());
      ++r.updates;
      ++version;
      for (const auto& tk : d->apply) done_with(tk);
    }
    for (int u = 0; u < workers; ++u) {
      if (!waiting[u] || !gate.may_start(u)) continue;
      int64_t slowest = done[u];
      for (int v = 0; v < workers; ++v) {
        if (live[v]) slowest = std::min(slowest, done[v]);
      }
      r.max_lead = std::max(r.max_lead, done[u] - slowest);
      waiting[u] = false;
      base[u] = version;
      gate.gave(u, version);
      events.push({t + step_time(u), u});
    }
  }
  EXPECT_EQ(gate.held(), 0) << "pushes left held: the gate deadlocked";
  for (int u = 0; u < workers; ++u) EXPECT_FALSE(waiting[u]) << "worker " << u << " never restarted";
  return r;
}

// ssp:S holds every worker within S steps of the slowest, for any S (also
// below N - 1), never deadlocks, and so bounds the staleness of what is
// applied: a push of step s goes before any of step s + S + 1 and is computed
// on at least s + (N - 1)(s - S) updates, so it is at most (2N - 1) S + N - 1
// versions stale; with S >= N - 1 at most S (the pushes are held too). The
// same slow worker under async breaks these bounds.
TEST(PsGate, SspHoldsTheClockBoundAndNeverDeadlocks) {
  for (int workers : {2, 3, 5}) {
    for (int64_t S : {0, 1, 2, 3, 4, 6}) {
      for (uint32_t seed = 1; seed <= 20; ++seed) {
        const auto r = simulate(Consistency::parse("ssp:" + std::to_string(S)), workers, 200, seed,
                                seed % 2 == 0, /*slow_factor=*/4);
        SCOPED_TRACE(::testing::Message() << workers << " workers, S " << S << ", seed " << seed);
        ASSERT_EQ(r.applied, workers * 200);
        ASSERT_LE(r.max_lead, S);
        ASSERT_LE(r.staleness.max(), (2 * workers - 1) * S + workers - 1);
        if (S >= workers - 1) ASSERT_LE(r.staleness.max(), S);  // the pushes' bound too
      }
    }
  }
  const auto a = simulate(Consistency::parse("async"), 3, 200, 1, false, 4);
  EXPECT_GT(a.max_lead, 3);
  EXPECT_GT(a.staleness.max(), 2);  // ssp:0's bound with 3 workers
}

TEST(PsGate, AsyncMeanStalenessIsWorkersMinusOne) {
  for (int workers : {2, 4}) {
    const auto r = simulate(Consistency::parse("async"), workers, 400, 7, false, 1);
    EXPECT_NEAR(r.staleness.mean(), workers - 1, 0.1) << workers << " workers";
  }
}

TEST(PsGate, DeterministicAppliesRoundRobin) {
  Gate gate(Consistency::parse("async"), 3, /*deterministic=*/true);
  gate.gave(0, 0);
  gate.gave(2, 0);
  // Arrivals 2, 1, 0 of seq 0: applied 0, 1, 2.
  gate.offer(Ticket{2, 0, 0, 10});
  gate.offer(Ticket{1, 0, 0, 11});
  gate.offer(Ticket{0, 0, 0, 12});
  EXPECT_FALSE(gate.next(0).has_value());  // worker 1 has not had its first parameters
  gate.gave(1, 0);
  std::vector<int> order;
  while (auto d = gate.next(0)) order.push_back(d->apply.at(0).worker);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  // A worker that is gone loses its turns.
  gate.gone(0);
  gate.offer(Ticket{2, 1, 0, 13});
  gate.offer(Ticket{1, 1, 0, 14});
  order.clear();
  while (auto d = gate.next(0)) order.push_back(d->apply.at(0).worker);
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
}

TEST(PsGate, SyncWaitsForTheQuorumAndDropsLatePushes) {
  Gate gate(Consistency::parse("sync:2"), 3, false);
  gate.offer(Ticket{2, 0, 0, 1});
  EXPECT_FALSE(gate.next(0).has_value());
  gate.offer(Ticket{0, 0, 0, 2});
  auto d = gate.next(0);
  ASSERT_TRUE(d.has_value());
  ASSERT_EQ(d->apply.size(), 2u);
  EXPECT_EQ(d->apply[0].worker, 0);  // worker order, not arrival order
  EXPECT_EQ(d->apply[1].worker, 2);
  gate.offer(Ticket{1, 0, 0, 3});  // computed on version 0, now 1: late
  d = gate.next(1);
  ASSERT_TRUE(d.has_value());
  EXPECT_TRUE(d->apply.empty());
  ASSERT_EQ(d->drop.size(), 1u);
  EXPECT_EQ(d->drop[0].worker, 1);
  // sync (all) with one worker gone: the quorum is the live ones.
  Gate all(Consistency::parse("sync"), 3, false);
  all.gone(1);
  all.offer(Ticket{0, 0, 0, 1});
  EXPECT_FALSE(all.next(0).has_value());
  all.offer(Ticket{2, 0, 0, 2});
  EXPECT_EQ(all.next(0)->apply.size(), 2u);
}

at::Tensor randn(int64_t n, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn({n}, g, at::kFloat);
}

TEST(PsCodecMessage, RoundTripWithinEachCodecsBound) {
  for (int64_t n : {1, 17, 97, 1000}) {
    const at::Tensor x = randn(n, n);
    const double absmax = x.abs().max().item<double>();
    struct Case {
      std::string spec;
      double tol;
    };
    for (const Case& c : {Case{"none", 0.0}, Case{"fp16", absmax / 1024},
                          Case{"bf16", absmax / 128}, Case{"int8", absmax / 254 * 1.0001}}) {
      const MessageCodec m = MessageCodec::parse(c.spec);
      const at::Tensor msg = m.encode(x, {});
      ASSERT_EQ(msg.numel(), m.message_bytes(n)) << c.spec;
      const at::Tensor y = m.decode(msg, n);
      EXPECT_LE((y - x).abs().max().item<double>(), c.tol) << c.spec << " n=" << n;
    }
    // topk:0.25 carries exactly the k largest |x| and zeros elsewhere.
    const MessageCodec t = MessageCodec::parse("topk:0.25");
    const at::Tensor y = t.decode(t.encode(x, {}), n);
    const int64_t k = (n + 3) / 4;
    EXPECT_EQ(y.ne(0).sum().item<int64_t>(), k);
    EXPECT_TRUE(at::equal(y.masked_select(y.ne(0)), x.masked_select(y.ne(0))));
  }
}

TEST(PsCodecMessage, ErrorFeedbackCarriesWhatWasNotSent) {
  for (const char* spec : {"fp16", "bf16", "int8:16", "topk:0.1"}) {
    const MessageCodec m = MessageCodec::parse(spec);
    at::Tensor e = at::zeros({97}, at::kFloat);
    at::Tensor sent = at::zeros({97}, at::kDouble), truth = at::zeros({97}, at::kDouble);
    for (int step = 0; step < 30; ++step) {
      const at::Tensor x = randn(97, 100 + step);
      const at::Tensor e_before = e.clone();
      const at::Tensor y = m.decode(m.encode(x, e), 97);
      // x + e_before == y + e_after, up to float32 rounding of the sums.
      EXPECT_TRUE(at::allclose(x + e_before, y + e, 1e-5, 1e-5)) << spec;
      sent += y.to(at::kDouble);
      truth += x.to(at::kDouble);
    }
    // The sum of what arrived trails the true sum by the residual alone.
    EXPECT_TRUE(at::allclose(sent + e.to(at::kDouble), truth, 1e-4, 1e-4)) << spec;
  }
}

TEST(PsCodecMessage, RefusesBadSpecsAndMessages) {
  EXPECT_NE(error_of([] { MessageCodec::parse("zstd"); }).find("unknown codec 'zstd'"),
            std::string::npos);
  EXPECT_NE(error_of([] { MessageCodec::parse("powersgd:2"); }).find("no point-to-point form"),
            std::string::npos);
  const MessageCodec m = MessageCodec::parse("fp16");
  EXPECT_NE(error_of([&] { m.decode(at::zeros({33}, at::kByte), 17); }).find("34 bytes, got 33"),
            std::string::npos);
  const MessageCodec t = MessageCodec::parse("topk:0.5");
  at::Tensor msg = t.encode(randn(4, 1), {});
  msg.view(at::kInt)[0] = 7;  // an index past the end
  EXPECT_NE(error_of([&] { t.decode(msg, 4); }).find("index outside"), std::string::npos);
  EXPECT_NE(error_of([] { MessageCodec::from_wire(9, 0, 0); }).find("codec id 9"),
            std::string::npos);
}

}  // namespace
