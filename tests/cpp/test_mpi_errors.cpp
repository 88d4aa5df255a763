// ddpx_mpi bad input under mpirun: each case is a c10::Error with a clear
// message on every rank, never a hang or a corrupted buffer, and the backend
// keeps working afterwards.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "mpi_test_util.h"
#include "plugin/comm/mpi_env.h"
#include "plugin/comm/mpi_util.h"

namespace {

using ddpx::test::world;

// Runs fn, expects a c10::Error whose message contains `needle`.
template <typename Fn>
void expect_error(Fn fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

void still_works() {
  std::vector<at::Tensor> t{at::ones({4})};
  world()->allreduce(t)->wait();
  EXPECT_TRUE(at::equal(t[0], at::full({4}, float(world()->getSize()))));
}

TEST(Errors, SizesDifferAcrossRanks) {
  auto& pg = world();
  const int r = pg->getRank();
  std::vector<at::Tensor> t{at::ones({10 + r})};
  expect_error([&] { pg->allreduce(t)->wait(); }, "ranks disagree on allreduce");
  // The victim buffer is untouched, not half-written.
  EXPECT_TRUE(at::equal(t[0], at::ones({10 + r})));
  std::vector<at::Tensor> b{at::zeros({5 + r})};
  expect_error([&] { pg->broadcast(b)->wait(); }, "ranks disagree on broadcast");
  auto out = at::empty({(4 + r) * pg->getSize()});
  auto in = at::ones({4 + r});
  expect_error([&] { pg->_allgather_base(out, in)->wait(); }, "ranks disagree on allgather");
  still_works();
}

TEST(Errors, DtypesDifferAcrossRanks) {
  auto& pg = world();
  std::vector<at::Tensor> t{at::ones({8}, pg->getRank() == 0 ? at::kFloat : at::kInt)};
  expect_error([&] { pg->allreduce(t)->wait(); }, "ranks disagree");
  still_works();
}

TEST(Errors, UnsupportedDtypeAndOp) {
  auto& pg = world();
  std::vector<at::Tensor> c{at::ones({4}, at::kComplexFloat)};
  expect_error([&] { pg->allreduce(c); }, "not supported");
  std::vector<at::Tensor> i{at::ones({4}, at::kInt)};
  c10d::AllreduceOptions avg;
  avg.reduceOp = c10d::ReduceOp::AVG;
  expect_error([&] { pg->allreduce(i, avg); }, "AVG needs a floating-point tensor");
  std::vector<at::Tensor> f{at::ones({4})};
  c10d::AllreduceOptions band;
  band.reduceOp = c10d::ReduceOp::BAND;
  expect_error([&] { pg->allreduce(f, band); }, "needs an integer or bool tensor");
  still_works();
}

TEST(Errors, SparseAndTensorCounts) {
  auto& pg = world();
  std::vector<at::Tensor> s{at::ones({4, 4}).to_sparse()};
  // Sparse tensors take the sparse path (as Gloo's), which only sums.
  c10d::AllreduceOptions max_op;
  max_op.reduceOp = c10d::ReduceOp::MAX;
  expect_error([&] { pg->allreduce(s, max_op); }, "only ReduceOp.SUM");
  std::vector<at::Tensor> two{at::ones({2}), at::ones({2})};
  expect_error([&] { pg->allreduce(two); }, "exactly one tensor");
  std::vector<at::Tensor> none;
  expect_error([&] { pg->broadcast(none); }, "exactly one tensor");
}

TEST(Errors, RanksOutOfRange) {
  auto& pg = world();
  const int n = pg->getSize();
  std::vector<at::Tensor> t{at::ones({2})};
  c10d::BroadcastOptions b;
  b.rootRank = n;
  expect_error([&] { pg->broadcast(t, b); }, "rootRank is " + std::to_string(n));
  c10d::ReduceOptions r;
  r.rootRank = -1;
  expect_error([&] { pg->reduce(t, r); }, "rootRank is -1");
  expect_error([&] { pg->send(t, n + 3, 0); }, "dstRank");
  expect_error([&] { pg->recv(t, -2, 0); }, "srcRank");
  expect_error([&] { pg->send(t, 0, -5); }, "tag must be");
}

TEST(Errors, WrongOutputShapes) {
  auto& pg = world();
  const int n = pg->getSize();
  auto in = at::ones({3});
  auto small = at::empty({3 * n - 1});
  expect_error([&] { pg->_allgather_base(small, in); }, "output must have group size");
  std::vector<std::vector<at::Tensor>> out(1, std::vector<at::Tensor>(n, at::empty({4})));
  std::vector<at::Tensor> ins{in};
  expect_error([&] { pg->allgather(out, ins); }, "outputTensors[0][i] has 4 elements");
  std::vector<int64_t> bad_split(n, 1);
  bad_split[0] = 7;
  auto a = at::ones({n});
  auto b = at::empty({n});
  std::vector<int64_t> none;
  expect_error([&] { pg->alltoall_base(b, a, none, bad_split); }, "split_sizes sum to");
  still_works();
}

TEST(Errors, RecvSmallerThanSend) {
  auto& pg = world();
  if (pg->getSize() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int r = pg->getRank();
  if (r == 0) {
    std::vector<at::Tensor> t{at::ones({100})};
    pg->send(t, 1, 3)->wait();
  } else if (r == 1) {
    std::vector<at::Tensor> t{at::zeros({10})};
    expect_error([&] { pg->recv(t, 0, 3)->wait(); }, "truncated");
  }
  still_works();
}

// Calls abandoned after a shrink (MpiEnv::recover; the same after a timeout)
// stay posted in MPI, and peers that come late still complete them: MPI then
// writes the memory it was given. So that memory outlives the caller's
// references until every call awaited with it has completed, and no longer.
TEST(Errors, AbandonedCallsKeepTheirMemoryUntilAllComplete) {
  using namespace ddpx::comm::detail;
  const int64_t n = 1 << 16;
  world();  // MPI initialised
  MPI_Comm comm = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &comm), MPI_SUCCESS);
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  if (rank == 0) {
    const int64_t before = abandoned_call_bytes();
    at::Tensor a = at::ones({n}), b = at::full({n}, 2.0f);
    const c10::weak_intrusive_ptr<c10::StorageImpl> weak_a(a.storage().getWeakStorageImpl());
    const c10::weak_intrusive_ptr<c10::StorageImpl> weak_b(b.storage().getWeakStorageImpl());
    // Two calls in flight together (as direct_calls posts them).
    std::vector<MPI_Request> reqs(2, MPI_REQUEST_NULL);
    MPI_Iallreduce(MPI_IN_PLACE, a.data_ptr(), n, MPI_FLOAT, MPI_SUM, comm, &reqs[0]);
    MPI_Iallreduce(MPI_IN_PLACE, b.data_ptr(), n, MPI_FLOAT, MPI_SUM, comm, &reqs[1]);
    std::thread shrink([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      MpiEnv::get().recover();
    });
    expect_error([&] { await_requests(reqs, {a, b}); }, "abandoning a collective");
    shrink.join();
    a.reset();
    b.reset();
    EXPECT_EQ(abandoned_call_bytes() - before, 2 * n * 4);
    auto kept_a = weak_a.lock();  // alive: kept for MPI
    auto kept_b = weak_b.lock();
    ASSERT_TRUE(kept_a && kept_b);
    MPI_Barrier(MPI_COMM_WORLD);  // the peers join the first call now
    MPI_Barrier(MPI_COMM_WORLD);  // ... and have finished it
    // The first call completes here too while this tests them; the second
    // is still posted, so both buffers stay.
    for (int i = 0; i < 200; ++i) {
      EXPECT_EQ(abandoned_call_bytes() - before, 2 * n * 4);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    MPI_Barrier(MPI_COMM_WORLD);  // the peers join the second call
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (abandoned_call_bytes() > before && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(abandoned_call_bytes(), before) << "the completed calls' memory was not let go";
    const float* got_a = static_cast<const float*>(kept_a->data());  // written after abandoning
    const float* got_b = static_cast<const float*>(kept_b->data());
    EXPECT_EQ(got_a[n - 1], float(size));
    EXPECT_EQ(got_b[n - 1], float(2 * size));
    kept_a.reset();
    kept_b.reset();
    EXPECT_TRUE(weak_a.expired() && weak_b.expired());
  } else {
    // Nonblocking as rank 0's (MPI matches no blocking collective with them).
    at::Tensor a = at::ones({n}), b = at::full({n}, 2.0f);
    MPI_Request r = MPI_REQUEST_NULL;
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Iallreduce(MPI_IN_PLACE, a.data_ptr(), n, MPI_FLOAT, MPI_SUM, comm, &r);
    MPI_Wait(&r, MPI_STATUS_IGNORE);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Iallreduce(MPI_IN_PLACE, b.data_ptr(), n, MPI_FLOAT, MPI_SUM, comm, &r);
    MPI_Wait(&r, MPI_STATUS_IGNORE);
    EXPECT_TRUE(at::equal(a, at::full({n}, float(size))));
    EXPECT_TRUE(at::equal(b, at::full({n}, float(2 * size))));
  }
  MPI_Comm_free(&comm);
  still_works();
}

// A backend destroyed while a receive it posted was never matched: its
// worker stops without waiting for it, the destructor returns (it used to
// detach the already joined thread: std::terminate), and the receive's
// Future fails (one held alone would have waited forever).
TEST(Errors, DestroyedWithAnUnmatchedRecv) {
  auto& pg = world();
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  {
    auto other = ddpx::comm::make_mpi_backend({}, std::chrono::milliseconds(5000));
    std::vector<at::Tensor> t{at::zeros({1 << 12})};
    if (other->getRank() == 0) fut = other->recv(t, 1, 77)->getFuture();  // never sent
  }
  if (fut) {
    // (completed on the completion queue's thread: its Future was handed out)
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!fut->completed() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_TRUE(fut->completed());
    ASSERT_TRUE(fut->hasError());
    EXPECT_NE(fut->tryRetrieveErrorMessage().find("destroyed before this send or receive was "
                                                  "matched"),
              std::string::npos)
        << fut->tryRetrieveErrorMessage();
  }
  pg->barrier()->wait();
  still_works();
}

// Which transfers MPI is handed CUDA memory for (mpi_util.h): a CUDA-aware
// library takes it in sends and receives; collectives (non-blocking here,
// which Open MPI's CUDA support does not cover) only when the user says so;
// DDPX_MPI_CUDA_AWARE=0 never; a library that is not CUDA-aware never.
TEST(CudaMemoryPolicy, CollectivesOnlyWhenAskedAndTheLibraryIsAware) {
  using ddpx::comm::detail::cuda_memory_policy;
  const auto is = [](ddpx::comm::detail::CudaMemoryPolicy p, bool p2p, bool coll) {
    return p.point_to_point == p2p && p.collectives == coll;
  };
  EXPECT_TRUE(is(cuda_memory_policy(nullptr, true), true, false));
  EXPECT_TRUE(is(cuda_memory_policy("", true), true, false));
  EXPECT_TRUE(is(cuda_memory_policy("1", true), true, true));
  EXPECT_TRUE(is(cuda_memory_policy("0", true), false, false));
  EXPECT_TRUE(is(cuda_memory_policy(nullptr, false), false, false));
  EXPECT_TRUE(is(cuda_memory_policy("1", false), false, false));
  expect_error([] { cuda_memory_policy("yes", true); }, "DDPX_MPI_CUDA_AWARE must be 0 or 1");
}

}  // namespace
