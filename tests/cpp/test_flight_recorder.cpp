// The flight recorder (issue 62) without MPI: the ring wraps and keeps the
// newest records whole while threads write it, a stamp never lands in a
// reused slot, a dump reads back as it was written, and the analysis names
// the rank, the sequence number and the cause.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "plugin/comm/flight_dump.h"
#include "plugin/comm/flight_recorder.h"
#include "plugin/comm/flight_report.h"

namespace {

using namespace ddpx::comm::detail;

FlightRecorder::Call call(int group, uint64_t seq, int64_t numel, FrOp op = FrOp::kAllReduce) {
  FlightRecorder::Call c;
  c.group = group;
  c.op = op;
  c.seq = seq;
  c.numel = numel;
  return c;
}

TEST(FlightRecorder, TheRingKeepsTheNewestInOrder) {
  FlightRecorder fr(4);
  const int g = fr.group({"0", "default_pg", {0, 1}, "ddpx_mpi"});
  std::vector<uint64_t> ids;
  for (uint64_t s = 1; s <= 10; ++s) ids.push_back(fr.record(call(g, s, 100 + s)));
  fr.started(ids[9]);
  fr.finished(ids[8]);
  fr.finished(ids[0]);  // long overwritten: refused
  const auto snap = fr.snapshot();
  ASSERT_EQ(snap.records.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const auto& r = snap.records[i];
    EXPECT_EQ(r.id, ids[6 + i]);
    EXPECT_EQ(r.collective_seq, 7 + i);
    ASSERT_EQ(r.input_sizes.size(), 1u);
    EXPECT_EQ(r.input_sizes[0], std::vector<int64_t>{107 + static_cast<int64_t>(i)});
  }
  EXPECT_EQ(snap.records[2].finished_ns != 0, true);
  EXPECT_EQ(snap.records[3].started_ns != 0, true);
  EXPECT_EQ(snap.records[3].finished_ns, 0);
  EXPECT_EQ(snap.records[0].finished_ns, 0);
  EXPECT_EQ(snap.status[g].enqueued, 10u);
  EXPECT_EQ(snap.status[g].finished, 9u);
}

TEST(FlightRecorder, OffRecordsNothing) {
  FlightRecorder fr(0);
  EXPECT_FALSE(fr.enabled());
  EXPECT_EQ(fr.record(call(0, 1, 1)), 0u);
  fr.finished(0);
  EXPECT_TRUE(fr.snapshot().records.empty());
}

// Writers on four threads while a reader takes snapshots: every record read
// is whole (its fields all from one write), in id order; at the end the ring
// holds its capacity of records (a writer the ring lapped does not clobber a
// newer record). The writers start once the reader has taken a snapshot.
TEST(FlightRecorder, SnapshotsWhileThreadsRecordAreWhole) {
  FlightRecorder fr(64);
  std::atomic<bool> stop{false};
  std::atomic<int> snaps{0};
  std::vector<std::thread> writers;
  for (int t = 0; t < 4; ++t) {
    writers.emplace_back([&fr, &snaps, t] {
      while (snaps.load() == 0) std::this_thread::yield();
      for (uint64_t i = 1; i <= 20000; ++i) {
        const uint64_t id = fr.record(call(t, i, static_cast<int64_t>(i) * 10 + t));
        if (i % 2) fr.finished(id, /*failed=*/i % 4 == 1);
      }
    });
  }
  std::thread reader([&] {
    while (!stop) {
      const auto s = fr.snapshot();
      uint64_t last = 0;
      for (const auto& r : s.records) {
        EXPECT_GT(r.id, last);
        last = r.id;
        ASSERT_EQ(r.input_sizes.size(), 1u);
        EXPECT_EQ(r.input_sizes[0][0], static_cast<int64_t>(r.collective_seq) * 10 + r.group);
        if (r.finished_ns != 0) {
          EXPECT_EQ(r.collective_seq % 2, 1u);
          EXPECT_EQ(r.failed, r.collective_seq % 4 == 1);
        }
      }
      ++snaps;
    }
  });
  for (auto& w : writers) w.join();
  stop = true;
  reader.join();
  EXPECT_GT(snaps, 0);
  EXPECT_EQ(fr.snapshot().records.size(), 64u);
}

TEST(FlightDump, ReadsBackAsWritten) {
  FlightRecorder fr(16);
  const int g = fr.group({"3", "tp", {0, 2}, "ddpx_mpi"});
  const int gs = fr.group({"3:gradsync", "GradSync buckets", {0, 1}, "gradsync"});
  const int names = fr.names({"fc.weight", "fc.bias"});
  std::vector<at::Tensor> ins{at::zeros({2, 3}, at::kHalf), at::zeros({5})};
  FlightRecorder::Call a = call(g, 1, -1);
  a.inputs = &ins;
  a.outputs = &ins;
  a.timeout_ms = 1234;
  fr.finished(fr.record(a));
  FlightRecorder::Call send = call(g, 1, 7, FrOp::kSend);
  send.p2p = true;
  send.peer = 1;
  fr.started(fr.record(send));
  FlightRecorder::Call b = call(gs, 1, 42);
  b.step = 9;
  b.bucket = 2;
  b.names = names;
  fr.record(b);
  const auto snap = fr.snapshot();
  const std::string bytes = fr_dump_bytes(snap, 2, "ddpx");
  const FrDump back = fr_parse_dump(bytes, "the dump");
  EXPECT_EQ(back.rank, 2);
  ASSERT_EQ(back.snap.groups.size(), 2u);
  EXPECT_EQ(back.snap.groups[0].ranks, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(back.snap.groups[0].desc, "tp");
  EXPECT_EQ(back.snap.groups[1].lib, "gradsync");
  ASSERT_EQ(back.snap.records.size(), 3u);
  const auto& r0 = back.snap.records[0];
  EXPECT_EQ(r0.op, FrOp::kAllReduce);
  EXPECT_EQ(r0.input_sizes, (std::vector<std::vector<int64_t>>{{2, 3}, {5}}));
  EXPECT_EQ(r0.input_dtypes, (std::vector<c10::ScalarType>{at::kHalf, at::kFloat}));
  EXPECT_EQ(r0.timeout_ms, 1234);
  EXPECT_NE(r0.finished_ns, 0);
  const auto& r1 = back.snap.records[1];
  EXPECT_TRUE(r1.p2p);
  EXPECT_EQ(r1.op, FrOp::kSend);
  EXPECT_EQ(r1.peer, 1);
  EXPECT_EQ(r1.p2p_seq, 1u);
  EXPECT_EQ(r1.finished_ns, 0);
  // "send 1->1": this is group rank 1 of {0, 2} (global rank 2).
  EXPECT_EQ(fr_profiling_name(snap.records[1], "ddpx_mpi", 1), "ddpx_mpi:send 1->1");
  const auto& r2 = back.snap.records[2];
  EXPECT_EQ(r2.step, 9);
  EXPECT_EQ(r2.bucket, 2);
  ASSERT_GE(r2.names, 0);
  EXPECT_EQ(back.snap.names[r2.names], (std::vector<std::string>{"fc.weight", "fc.bias"}));
  EXPECT_THROW(fr_parse_dump("not a pickle", "junk"), c10::Error);
}

// One rank's view: collectives 1..n of a 3-rank group, all done but the last.
FrSnapshot rank_view(int n, int mismatch_at = 0, FrOp other = FrOp::kBroadcast) {
  FlightRecorder fr(100);
  const int g = fr.group({"0", "default_pg", {0, 1, 2}, "ddpx_mpi"});
  for (int s = 1; s <= n; ++s) {
    const uint64_t id = fr.record(call(g, s, 64, s == mismatch_at ? other : FrOp::kAllReduce));
    if (s < n) fr.finished(id);
  }
  return fr.snapshot();
}

TEST(FlightReport, NamesTheRankThatIssuedAnotherCall) {
  const auto report =
      fr_analyze({{0, rank_view(6)}, {1, rank_view(6)}, {2, rank_view(6, 4)}}, {0, 1, 2});
  ASSERT_FALSE(report.findings.empty());
  const auto& f = report.findings.front();
  EXPECT_EQ(f.kind, FrFinding::Kind::kMismatch);
  EXPECT_EQ(f.seq, 4u);
  EXPECT_EQ(f.ranks, std::vector<int>{2});
  EXPECT_NE(f.text.find("broadcast"), std::string::npos) << f.text;
}

TEST(FlightReport, NamesTheRankBehindAndTheOneThatDidNotAnswer) {
  const auto report = fr_analyze({{0, rank_view(9)}, {1, rank_view(6)}}, {0, 1, 2});
  ASSERT_EQ(report.findings.size(), 2u) << report.text;
  EXPECT_EQ(report.findings[0].kind, FrFinding::Kind::kBehind);
  EXPECT_EQ(report.findings[0].ranks, std::vector<int>{1});
  EXPECT_EQ(report.findings[0].seq, 9u);
  EXPECT_NE(report.findings[0].text.find("3 collectives behind"), std::string::npos) << report.text;
  EXPECT_EQ(report.findings[1].kind, FrFinding::Kind::kNoAnswer);
  EXPECT_EQ(report.findings[1].ranks, std::vector<int>{2});
}

TEST(FlightReport, AHealthyJobHasNoFinding) {
  const auto report = fr_analyze({{0, rank_view(5)}, {1, rank_view(5)}, {2, rank_view(5)}}, {});
  EXPECT_TRUE(report.findings.empty()) << report.text;
}

}  // namespace
