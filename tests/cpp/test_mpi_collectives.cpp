// ddpx_mpi under mpirun (2 and 3 ranks): every reduction x dtype x op against
// values computed locally, plus non-contiguous, empty and multi-tensor forms.
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <chrono>
#include <thread>
#include <tuple>

#include "mpi_test_util.h"
#include "sanitizer.h"

namespace {

using ddpx::test::rank_values;
using ddpx::test::world;
using c10d::ReduceOp;

// The expected reduction of rank_values over all ranks, computed in double.
at::Tensor expected(int64_t n, at::ScalarType dtype, ReduceOp::RedOpType op, int size) {
  at::Tensor acc;
  for (int r = 0; r < size; ++r) {
    auto v = rank_values(r, n, dtype).to(at::kDouble);
    if (r == 0) {
      acc = v;
      continue;
    }
    switch (op) {
      case ReduceOp::SUM:
      case ReduceOp::AVG: acc = dtype == at::kBool ? at::maximum(acc, v) : acc + v; break;
      case ReduceOp::PRODUCT: acc = dtype == at::kBool ? at::minimum(acc, v) : acc * v; break;
      case ReduceOp::MIN: acc = at::minimum(acc, v); break;
      case ReduceOp::MAX: acc = at::maximum(acc, v); break;
      default: ADD_FAILURE() << "op not covered";
    }
  }
  if (op == ReduceOp::AVG) acc = acc / size;
  return acc.to(dtype);
}

using Case = std::tuple<at::ScalarType, ReduceOp::RedOpType>;

class AllreduceTest : public ::testing::TestWithParam<Case> {};

TEST_P(AllreduceTest, MatchesLocalReduction) {
  auto [dtype, op] = GetParam();
  auto& pg = world();
  for (int64_t n : {1, 17, 97, 4099}) {
    std::vector<at::Tensor> t{rank_values(pg->getRank(), n, dtype)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = ReduceOp(op);
    pg->allreduce(t, opts)->wait();
    auto want = expected(n, dtype, op, pg->getSize());
    if (op == ReduceOp::AVG && dtype != at::kFloat && dtype != at::kDouble) {
      EXPECT_TRUE(at::allclose(t[0].to(at::kDouble), want.to(at::kDouble), 1e-2, 1e-2)) << n;
    } else {
      EXPECT_TRUE(at::equal(t[0], want)) << "n=" << n;
    }
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> v;
  for (auto dt : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kChar, at::kByte, at::kInt,
                  at::kLong, at::kBool}) {
    for (auto op : {ReduceOp::SUM, ReduceOp::PRODUCT, ReduceOp::MIN, ReduceOp::MAX}) {
      v.emplace_back(dt, op);
    }
    if (at::isFloatingType(dt)) v.emplace_back(dt, ReduceOp::AVG);
  }
  return v;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  static const char* ops[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX"};
  return std::string(c10::toString(std::get<0>(info.param))) + "_" +
         ops[static_cast<int>(std::get<1>(info.param))];
}

INSTANTIATE_TEST_SUITE_P(DtypeOp, AllreduceTest, ::testing::ValuesIn(all_cases()), case_name);

TEST(Allreduce, NonContiguousAndEmpty) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  auto base = at::full({6, 4}, static_cast<float>(r + 1));
  std::vector<at::Tensor> t{base.t()};  // [4, 6] view with strides (1, 4)
  ASSERT_FALSE(t[0].is_contiguous());
  pg->allreduce(t)->wait();
  EXPECT_TRUE(at::equal(base, at::full({6, 4}, n * (n + 1) / 2.0f)));
  std::vector<at::Tensor> empty{at::empty({0, 3})};
  pg->allreduce(empty)->wait();
  EXPECT_EQ(empty[0].numel(), 0);
}

TEST(Allreduce, Coalesced) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  std::vector<at::Tensor> ts{at::full({3}, float(r)), at::full({2, 2}, float(2 * r)),
                             at::empty({0})};
  pg->allreduce_coalesced(ts)->wait();
  const float s = n * (n - 1) / 2.0f;
  EXPECT_TRUE(at::equal(ts[0], at::full({3}, s)));
  EXPECT_TRUE(at::equal(ts[1], at::full({2, 2}, 2 * s)));
}

TEST(Broadcast, EveryRootAndDtype) {
  auto& pg = world();
  for (auto dtype : {at::kFloat, at::kHalf, at::kLong, at::kBool}) {
    for (int root = 0; root < pg->getSize(); ++root) {
      std::vector<at::Tensor> t{rank_values(pg->getRank(), 33, dtype)};
      c10d::BroadcastOptions o;
      o.rootRank = root;
      pg->broadcast(t, o)->wait();
      EXPECT_TRUE(at::equal(t[0], rank_values(root, 33, dtype))) << "root " << root;
    }
  }
}

TEST(Reduce, OnlyRootReceives) {
  auto& pg = world();
  for (int root = 0; root < pg->getSize(); ++root) {
    auto mine = rank_values(pg->getRank(), 17, at::kInt);
    std::vector<at::Tensor> t{mine.clone()};
    c10d::ReduceOptions o;
    o.rootRank = root;
    pg->reduce(t, o)->wait();
    if (pg->getRank() == root) {
      EXPECT_TRUE(at::equal(t[0], expected(17, at::kInt, ReduceOp::SUM, pg->getSize())));
    }
  }
}

TEST(Allgather, ListAndBase) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kByte}) {
    std::vector<at::Tensor> in{rank_values(r, 7, dtype)};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int i = 0; i < n; ++i) out[0].push_back(at::empty({7}, dtype));
    pg->allgather(out, in)->wait();
    for (int i = 0; i < n; ++i) EXPECT_TRUE(at::equal(out[0][i], rank_values(i, 7, dtype)));
    auto flat = at::empty({n * 7}, dtype);
    pg->_allgather_base(flat, in[0])->wait();
    for (int i = 0; i < n; ++i) EXPECT_TRUE(at::equal(flat.narrow(0, 7 * i, 7), rank_values(i, 7, dtype)));
  }
}

TEST(GatherScatter, EveryRoot) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  for (int root = 0; root < n; ++root) {
    std::vector<at::Tensor> in{rank_values(r, 5, at::kDouble)};
    std::vector<std::vector<at::Tensor>> out;
    if (r == root) {
      out.emplace_back();
      for (int i = 0; i < n; ++i) out[0].push_back(at::empty({5}, at::kDouble));
    }
    c10d::GatherOptions g;
    g.rootRank = root;
    pg->gather(out, in, g)->wait();
    if (r == root) {
      for (int i = 0; i < n; ++i) EXPECT_TRUE(at::equal(out[0][i], rank_values(i, 5, at::kDouble)));
    }
    std::vector<at::Tensor> recv{at::empty({5}, at::kDouble)};
    std::vector<std::vector<at::Tensor>> send;
    if (r == root) {
      send.emplace_back();
      for (int i = 0; i < n; ++i) send[0].push_back(at::full({5}, double(10 * i + root), at::kDouble));
    }
    c10d::ScatterOptions s;
    s.rootRank = root;
    pg->scatter(recv, send, s)->wait();
    EXPECT_TRUE(at::equal(recv[0], at::full({5}, double(10 * r + root), at::kDouble)));
  }
}

TEST(ReduceScatter, ListAndBase) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  // Rank r contributes (r + 1) * (i + 1) to chunk i.
  std::vector<std::vector<at::Tensor>> in(1);
  for (int i = 0; i < n; ++i) in[0].push_back(at::full({4}, float((r + 1) * (i + 1))));
  std::vector<at::Tensor> out{at::empty({4})};
  pg->reduce_scatter(out, in)->wait();
  const float tri = n * (n + 1) / 2.0f;
  EXPECT_TRUE(at::equal(out[0], at::full({4}, tri * (r + 1))));
  auto flat = at::cat(in[0]);
  auto o = at::empty({4});
  c10d::ReduceScatterOptions avg;
  avg.reduceOp = ReduceOp::AVG;
  pg->_reduce_scatter_base(o, flat, avg)->wait();
  EXPECT_TRUE(at::allclose(o, at::full({4}, tri * (r + 1) / n)));
}

TEST(Alltoall, EqualAndUnevenSplits) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  auto in = at::arange(n * 2, at::kFloat) + 100 * r;  // 2 rows for each peer
  auto out = at::empty({n * 2});
  std::vector<int64_t> none;
  pg->alltoall_base(out, in, none, none)->wait();
  for (int src = 0; src < n; ++src) {
    EXPECT_TRUE(at::equal(out.narrow(0, 2 * src, 2), at::arange(2 * r, 2 * r + 2, at::kFloat) + 100 * src));
  }
  // Rank r sends j + 1 rows to rank j, so it receives r + 1 rows from everyone.
  std::vector<int64_t> in_splits, out_splits;
  for (int j = 0; j < n; ++j) {
    in_splits.push_back(j + 1);
    out_splits.push_back(r + 1);
  }
  auto in2 = at::full({n * (n + 1) / 2, 3}, float(r));
  auto out2 = at::empty({n * (r + 1), 3});
  pg->alltoall_base(out2, in2, out_splits, in_splits)->wait();
  for (int src = 0; src < n; ++src) {
    EXPECT_TRUE(at::equal(out2.narrow(0, src * (r + 1), r + 1), at::full({r + 1, 3}, float(src))));
  }
  std::vector<at::Tensor> ins, outs;
  for (int j = 0; j < n; ++j) {
    ins.push_back(at::full({j + 1}, float(r)));
    outs.push_back(at::empty({r + 1}));
  }
  pg->alltoall(outs, ins)->wait();
  for (int src = 0; src < n; ++src) EXPECT_TRUE(at::equal(outs[src], at::full({r + 1}, float(src))));
}

TEST(PointToPoint, RingAndAnySource) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  // Everyone sends first, then receives: must not deadlock (sends are posted
  // non-blocking), even for a message far above any eager limit.
  std::vector<at::Tensor> s{at::full({1 << 20}, float(r))};
  std::vector<at::Tensor> d{at::empty({1 << 20})};
  auto ws = pg->send(s, (r + 1) % n, 7);
  auto wr = pg->recv(d, (r + n - 1) % n, 7);
  ws->wait();
  wr->wait();
  EXPECT_TRUE(at::equal(d[0], at::full({1 << 20}, float((r + n - 1) % n))));
  if (r == 0) {
    for (int i = 1; i < n; ++i) {
      std::vector<at::Tensor> t{at::empty({3}, at::kLong)};
      auto w = pg->recvAnysource(t, 9);
      w->wait();
      const int src = w->sourceRank();
      EXPECT_TRUE(at::equal(t[0], at::full({3}, int64_t(src), at::kLong)));
    }
  } else {
    std::vector<at::Tensor> t{at::full({3}, int64_t(r), at::kLong)};
    pg->send(t, 0, 9)->wait();
  }
  pg->barrier()->wait();
}

TEST(Async, FutureCarriesResult) {
  auto& pg = world();
  std::vector<at::Tensor> t{at::ones({8})};
  auto w = pg->allreduce(t);
  auto fut = w->getFuture();
  fut->wait();
  auto result = fut->value().toTensorVector();
  ASSERT_EQ(result.size(), 1u);
  EXPECT_TRUE(at::equal(result[0], at::full({8}, float(pg->getSize()))));
  EXPECT_TRUE(w->isCompleted());
  EXPECT_TRUE(w->isSuccess());
}

// The worker naps while a collective waits for a peer instead of spinning in
// MPI (await_request): rank 0 enters an allreduce 1.5 s before the others,
// and its process (every thread) burns well under 40% of that. A blocking
// MPI_Allreduce polls at 100% of a core the whole time; the naps measure
// 9-10% here (each wake-up runs Open MPI's progress loop; 19-24% with naps of
// 100 us), so the bound sits between the two with room for a loaded machine
// (a quarter of the wait failed once in CI, at 25.2%, with 100 us naps).
TEST(Async, WaitingForAPeerDoesNotSpin) {
  // Its shadow-memory bookkeeping and background thread burn CPU of their
  // own, so the bound would measure the instrumentation, not the naps.
  if (ddpx::test::kThreadSanitizer) GTEST_SKIP() << "CPU time is not comparable under TSan";
  auto& pg = world();
  pg->barrier()->wait();
  auto cpu_s = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
  };
  if (pg->getRank() != 0) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const double cpu0 = cpu_s();
  const auto wall0 = std::chrono::steady_clock::now();
  std::vector<at::Tensor> t{at::ones({1024})};
  pg->allreduce(t)->wait();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  const double cpu = cpu_s() - cpu0;
  EXPECT_TRUE(at::equal(t[0], at::full({1024}, static_cast<float>(pg->getSize()))));
  if (pg->getRank() == 0) {
    EXPECT_GT(wall, 1.0);
    EXPECT_LT(cpu, 0.4 * wall) << "the wait used " << cpu << " s of CPU in " << wall << " s";
  }
}

}  // namespace
