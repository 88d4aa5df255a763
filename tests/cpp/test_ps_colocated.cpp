// Colocated parameter-server shards (ps::kColocated) under mpirun, np 1, 2
// and 3: every rank trains and serves 1/W of the parameters (the model's
// first weight is split between ranks from np 2 on). As in test_ps.cpp every
// rank recomputes every worker's gradient and builds the reference locally:
//   one rank                  == local SGD / Adam, bitwise (every consistency)
//   sync                      == synchronous data-parallel SGD, mean summed in
//                                worker order, bitwise
//   deterministic async       == the round-robin order applied in one process,
//                                bitwise (with and without delay compensation)
//   ssp:S                     no worker more than S steps ahead of the slowest
//   every push codec (sync)   == data-parallel SGD on the decoded gradients, each
//                                worker's error feedback per (shard, segment), bitwise
//   checkpoint/resume (sync)  == the uninterrupted run, bitwise
#include <ATen/ATen.h>
#include <ddpx/ps.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <map>
#include <random>
#include <thread>

#include "plugin/comm/codec_message.h"
#include "plugin/ps/layout.h"
#include "plugin/ps/wire.h"
#include "mpi_test_util.h"
#include "ps_test_util.h"

namespace {

using ddpx::test::error_of;
using namespace ddpx::test::ps_util;

int my_rank() { return ddpx::comm::detail::MpiEnv::get().world_rank(); }

ps::Options colocated(const std::string& consistency, const std::string& opt = "sgd") {
  return options(ps::kColocated, consistency, opt);
}

// Synchronous data parallel on the decoded gradients: each update is the
// mean, summed in worker order, of every worker's gradient at that step
// after the push codec (none: as computed). Error feedback is kept per
// (worker, shard, segment), as each worker keeps it.
std::vector<at::Tensor> data_parallel(int workers, int64_t steps, const std::string& opt,
                                      const std::string& codec_spec = "none") {
  const auto codec = ddpx::comm::MessageCodec::parse(codec_spec);
  auto ref = make_params();
  auto sgd = make_opt(opt, ref);
  auto scratch = clone_params(ref);
  std::vector<int64_t> numels;
  for (const auto& p : ref) numels.push_back(p.numel());
  const auto layout = ps::detail::Layout::plan(numels, workers);
  std::map<std::tuple<int, int, size_t>, at::Tensor> residual;
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<at::Tensor> sum;
    for (int w = 0; w < workers; ++w) {
      copy_params(scratch, ref);
      compute_grads(scratch, w, s);
      std::vector<at::Tensor> g;
      for (const auto& p : scratch) g.push_back(at::empty({p.numel()}, at::kFloat));
      for (int k = 0; k < workers; ++k) {
        for (size_t i = 0; i < layout.shards[k].size(); ++i) {
          const auto& sg = layout.shards[k][i];
          const at::Tensor x =
              scratch[sg.param].grad().reshape(-1).narrow(0, sg.offset, sg.numel).contiguous();
          at::Tensor d = x;
          if (codec.id != ddpx::comm::WireCodec::None) {
            at::Tensor& e = residual[{w, k, i}];
            if (!e.defined()) e = at::zeros_like(x);
            d = codec.decode(codec.encode(x, e), sg.numel);
          }
          g[sg.param].narrow(0, sg.offset, sg.numel).copy_(d);
        }
      }
      for (size_t i = 0; i < g.size(); ++i) {
        if (w == 0)
          sum.push_back(g[i]);
        else
          sum[i].add_(g[i]);
      }
    }
    for (size_t i = 0; i < ref.size(); ++i) {
      ref[i].mutable_grad() = (workers > 1 ? sum[i].div_(double(workers)) : sum[i]).view(ref[i].sizes());
    }
    set_lr(*sgd, lr_at(s));
    sgd->step();
  }
  return ref;
}

class ColocatedOptimizer : public ::testing::TestWithParam<std::string> {};

// One rank: its worker and its server talk through memory alone, and every
// consistency is local training.
TEST_P(ColocatedOptimizer, OneRankEqualsLocalTraining) {
  if (world_size() != 1) GTEST_SKIP() << "np 1";
  const int64_t steps = 25;
  for (const std::string c : {"async", "ssp:0", "sync"}) {
    SCOPED_TRACE(c);
    const auto got = run_ps(colocated(c, GetParam()), steps);
    expect_bitwise(got.params, data_parallel(1, steps, GetParam()));
    EXPECT_EQ(got.stats.version, steps);
    EXPECT_EQ(got.stats.staleness.max(), 0);
    EXPECT_EQ(got.stats.workers_lost, 0);
  }
}

// sync: every update is the mean of the W gradients on the same parameters.
TEST_P(ColocatedOptimizer, SyncEqualsDataParallel) {
  const int n = world_size();
  const int64_t steps = 12;
  auto o = colocated("sync", GetParam());
  o.max_push_delay_us = 1000;
  const auto got = run_ps(o, steps);
  expect_bitwise(got.params, data_parallel(n, steps, GetParam()));
  EXPECT_EQ(got.stats.version, steps);
  EXPECT_EQ(got.stats.applied, n * n * steps);  // every push reaches every shard
  EXPECT_EQ(got.stats.staleness.max(), 0);
  // Each worker's parameters after its last pull are the servers' values.
  expect_bitwise(got.held, got.params);
}
INSTANTIATE_TEST_SUITE_P(Ps, ColocatedOptimizer, ::testing::Values("sgd", "adam"));

// Random delays scramble the arrival order; the round-robin application
// must not change. Bytes: each push's header and segment lengths per shard
// (the rank's own shard included, though it never crosses a link).
TEST(PsColocated, DeterministicEqualsSequentialApplication) {
  const int n = world_size();
  if (n < 2) GTEST_SKIP() << "needs two workers";
  for (const double dc : {0.0, 2.0}) {
    SCOPED_TRACE(::testing::Message() << "delay_comp " << dc);
    auto o = colocated("async");
    o.deterministic = true;
    o.delay_comp = dc;
    o.max_push_delay_us = 2000;
    const int64_t steps = 15;
    const auto got = run_ps(o, steps);
    expect_bitwise(got.params, sequential_round_robin(n, steps, false, dc));
    const auto layout = ps::detail::Layout::plan({65, 13, 39, 3}, n);
    int64_t per_push = n * static_cast<int64_t>(sizeof(ps::detail::PushHeader)) +
                       (dc > 0 ? 2 : 1) * 4 * 120;
    for (const auto& shard : layout.shards) per_push += 8 * static_cast<int64_t>(shard.size());
    EXPECT_EQ(got.stats.bytes_received, n * steps * per_push);
  }
}

// ssp:S, every rank a worker (expect_ssp_bounds).
TEST(PsColocated, SspHoldsEachWorkerWithinSStepsOfTheSlowest) {
  const int n = world_size();
  if (n < 2) GTEST_SKIP() << "needs two workers";
  expect_ssp_bounds(ps::kColocated, n);
}

// Every push codec under sync, the first weight split between shards.
class ColocatedCodec : public ::testing::TestWithParam<std::string> {};
TEST_P(ColocatedCodec, SyncEqualsDataParallelOnTheDecodedGradients) {
  const int n = world_size();
  const int64_t steps = 15;
  auto o = colocated("sync");
  o.codec = GetParam();
  const auto got = run_ps(o, steps);
  expect_bitwise(got.params, data_parallel(n, steps, "sgd", GetParam()));
  EXPECT_EQ(got.stats.bytes_raw, n * steps * 4 * 120);  // each push's shards: the model
}
INSTANTIATE_TEST_SUITE_P(Ps, ColocatedCodec,
                         ::testing::Values("none", "fp16", "bf16", "int8:16", "topk:0.3"),
                         codec_test_name);

// Pulls through a codec, one rank: local training on the copy the deltas
// build (test_ps.cpp's PsPullCodec, in memory).
TEST(PsColocated, OneRankPullCodecTrains) {
  if (world_size() != 1) GTEST_SKIP() << "np 1";
  auto o = colocated("async");
  o.pull_codec = "int8:16";
  const auto got = run_ps(o, 25);
  EXPECT_EQ(got.worker.pulls, 26);
  EXPECT_LT(got.worker.pull_bytes, got.worker.pull_bytes_raw / 2);
  EXPECT_FALSE(at::equal(got.params[0], make_params()[0]));
}

// Stopped after 8 of 12 steps and restored from each rank's server
// checkpoint (and, with int8, each worker's residuals): bitwise the
// uninterrupted run.
TEST(PsColocated, ResumeEqualsUninterrupted) {
  for (const std::string codec : {"none", "int8"}) {
    SCOPED_TRACE(codec);
    auto with_codec = [&] {
      auto o = colocated("sync");
      o.codec = codec;
      return o;
    };
    const auto whole = run_ps(with_codec(), 12);
    std::string state, at8;
    auto o = with_codec();
    o.checkpoint_every = 4;
    o.on_checkpoint = [&](const std::string& bytes) { state = bytes; };
    run_ps(o, 8, {}, "", [&](ps::Worker& w) {
      if (w.stats().pushes == 8) at8 = w.save_residuals();
    });
    const auto resumed = run_ps(with_codec(), 12, {}, state, {}, [&](ps::Worker& w) {
      EXPECT_EQ(w.start_step(), 8);
      EXPECT_TRUE(w.restore_residuals(at8));
    });
    expect_bitwise(resumed.params, whole.params);
    EXPECT_EQ(resumed.stats.version, 12);
  }
}

TEST(PsColocated, MisuseIsAnErrorSayingWhatToDo) {
  auto params = make_params();
  ps::Session session(params, colocated("async"));
  EXPECT_TRUE(session.is_server() && session.is_worker() && session.colocated());
  EXPECT_EQ(session.num_servers(), world_size());
  EXPECT_EQ(session.num_workers(), world_size());
  const auto before = error_of([&] { ps::Worker w(session); });
  EXPECT_NE(before.find("serves a shard too (colocated): call Server::start() before making its "
                        "Worker"),
            std::string::npos)
      << before;
  ps::Server server(session);
  const auto serve = error_of([&] { server.serve(); });
  EXPECT_NE(serve.find("colocated servers serve on a thread of their own"), std::string::npos)
      << serve;
  EXPECT_NE(error_of([&] { server.join(); }).find("join() without start()"), std::string::npos);
  server.start();
  EXPECT_NE(error_of([&] { server.start(); }).find("start() called twice"), std::string::npos);
  {
    ps::Worker w(session);
    w.pull();
    w.finish();
  }
  server.join();
  session.share_final(params);
}

}  // namespace
