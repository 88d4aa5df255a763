// Faults of the parameter server, never a hang (ddpx/ps.h, step 6), with a
// 2 s timeout:
//   a frozen server (np 2): the worker fails within the timeout plus a margin,
//     with an error naming the server;
//   a frozen worker (np 3, SIGSTOP): the server drops it and the other worker
//     finishes its training, and the two share the final values without it
//     (rank 0 then ends the job at exit with MPI_Abort, code 0); woken up
//     after the server is done, the frozen one fails with the error too;
//   a frozen rank under colocated servers (np 2, 3): its shard is gone with
//     it, so every other rank's worker fails within the timeout plus a
//     margin, naming that server; woken, the frozen one fails too.
#include <ATen/ATen.h>
#include <ddpx/ps.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <signal.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "plugin/comm/mpi_env.h"
#include "mpi_test_util.h"

namespace ps = ddpx::ps;
using Clock = std::chrono::steady_clock;

namespace {

constexpr double kTimeout = 2.0;

ps::Options options() {
  ps::Options o;
  o.timeout_s = kTimeout;
  o.make_optimizer = [](std::vector<at::Tensor> p) {
    return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
  };
  return o;
}

std::vector<at::Tensor> params() { return {at::ones({7}).requires_grad_(true)}; }

void step(const std::vector<at::Tensor>& p) { p[0].mutable_grad() = at::full({7}, 0.5); }

using ddpx::test::error_of;

TEST(PsFaults, FrozenServerFailsTheWorkersInTime) {
  const int size = ddpx::comm::detail::MpiEnv::get().world_size();
  if (size != 2) GTEST_SKIP() << "np 2";
  auto p = params();
  ps::Session session(p, options());
  if (session.is_server()) {
    // Never serves: as a SIGSTOPped server, it takes nothing and says nothing.
    std::this_thread::sleep_for(std::chrono::duration<double>(kTimeout + 2));
  } else {
    ps::Worker worker(session);
    const auto t0 = Clock::now();
    const auto err = error_of([&] { worker.pull(); });
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    EXPECT_NE(err.find("server 0 (rank 0) sent nothing for 2 s"), std::string::npos) << err;
    EXPECT_GE(took, kTimeout * 0.9);
    EXPECT_LT(took, kTimeout + 1.5);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(PsFaults, FrozenWorkerIsDroppedAndTrainingGoesOn) {
  const int size = ddpx::comm::detail::MpiEnv::get().world_size();
  const int rank = ddpx::comm::detail::MpiEnv::get().world_rank();
  if (size != 3) GTEST_SKIP() << "np 3: a server and two workers";
  int pid = getpid();
  std::vector<int> pids(size);
  MPI_Allgather(&pid, 1, MPI_INT, pids.data(), 1, MPI_INT, MPI_COMM_WORLD);
  auto p = params();
  ps::Session session(p, options());
  const int64_t steps = 40;
  if (session.is_server()) {
    const auto st = ps::Server(session).serve();
    EXPECT_EQ(st.workers_lost, 1);
    // Worker 1 froze after 3 pushes; worker 0 pushed all of its.
    EXPECT_EQ(st.applied, steps + 3);
    kill(pids[2], SIGCONT);
  } else {
    ps::Worker worker(session);
    const int w = rank - 1;
    const auto err = error_of([&] {
      for (int64_t s = 0; s < steps; ++s) {
        worker.pull();
        step(p);
        if (w == 1 && s == 3) raise(SIGSTOP);  // frozen, heartbeat thread included
        worker.push();
        std::this_thread::sleep_for(std::chrono::milliseconds(w == 0 ? 100 : 0));
      }
      worker.finish();
    });
    if (w == 0) {
      EXPECT_EQ(err, "");
    } else {
      EXPECT_NE(err.find("sent nothing for 2 s"), std::string::npos) << err;
    }
  }
  if (rank != 2) {
    // The server and worker 0 finish without the dropped one (step 7):
    // worker 0 ends with the server's values, and both know who is missing.
    p[0].mutable_grad() = at::Tensor();
    if (rank == 1) p[0].detach().fill_(-1);
    session.share_final(p);
    EXPECT_EQ(session.lost_ranks(), std::vector<int>{2});
    EXPECT_EQ(session.final_size(), 2);
    EXPECT_EQ(session.final_rank(), rank);
    const auto sum = session.sum_final(p[0].detach().to(at::kDouble));
    EXPECT_TRUE(at::equal(sum, 2 * p[0].detach().to(at::kDouble)));
    // 43 gradients of 0.5 at lr 0.1 from 1.
    EXPECT_TRUE(at::allclose(p[0].detach(), at::full({7}, 1 - 43 * 0.05), 1e-5, 1e-5));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(PsFaults, ColocatedFrozenRankFailsTheOthersNamingItsShard) {
  const int size = ddpx::comm::detail::MpiEnv::get().world_size();
  const int rank = ddpx::comm::detail::MpiEnv::get().world_rank();
  if (size < 2) GTEST_SKIP() << "np 2, 3";
  int pid = getpid();
  std::vector<int> pids(size);
  MPI_Allgather(&pid, 1, MPI_INT, pids.data(), 1, MPI_INT, MPI_COMM_WORLD);
  const int frozen = size - 1;
  auto p = params();
  auto o = options();
  o.servers = ps::kColocated;
  ps::Session session(p, o);
  std::string err;
  double took = 0;
  {
    ps::Server server(session);
    server.start();
    ps::Worker worker(session);
    const auto t0 = Clock::now();
    err = error_of([&] {
      for (int64_t s = 0; s < 1000; ++s) {
        worker.pull();
        step(p);
        if (rank == frozen && s == 3) raise(SIGSTOP);  // every thread of the rank
        worker.push();
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      worker.finish();
      server.join();
    });
    took = std::chrono::duration<double>(Clock::now() - t0).count();
  }  // ~Server stops a server that is still serving
  if (rank != frozen) {
    const std::string want = "server " + std::to_string(frozen) + " (rank " +
                             std::to_string(frozen) + ") sent nothing for 2 s";
    EXPECT_NE(err.find(want), std::string::npos) << err;
    EXPECT_LT(took, kTimeout + 2.0);
    if (rank == 0) kill(pids[frozen], SIGCONT);
  } else {
    EXPECT_NE(err.find("sent nothing for 2 s"), std::string::npos) << err;
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
