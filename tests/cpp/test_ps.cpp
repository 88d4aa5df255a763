// The parameter server end to end under mpirun (ddpx/ps.h): np 2, 3 and 4,
// the first K ranks serve. Every rank can recompute every worker's gradient
// (data seeded by worker and step), so each rank builds the reference run
// locally and compares after Session::share_final:
//   one worker                == local SGD / Adam, bitwise (any K: split tensors)
//   deterministic async       == the same round-robin order applied in one process, bitwise
//   sync (n = N)              == synchronous data-parallel SGD, mean summed in worker
//                                order, bitwise
//   pushes through a codec    == local SGD on the codec's decoded gradients with the
//                                same per-segment error feedback, bitwise
//   pulls through a codec     == local SGD whose gradients are taken on a copy that
//                                follows by decoded shard deltas, bitwise
//   ssp:S                     no worker more than S steps ahead of the slowest;
//                                S >= N - 1: applied staleness <= S
//   async, N equal workers    mean staleness within 0.35 of N - 1
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ddpx/ps.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <random>
#include <sstream>
#include <thread>

#include "plugin/comm/codec_message.h"
#include "plugin/comm/mpi_env.h"
#include "plugin/ps/layout.h"
#include "plugin/ps/session_state.h"
#include "plugin/ps/wire.h"
#include "mpi_test_util.h"
#include "ps_test_util.h"

namespace ps = ddpx::ps;

namespace {

using ddpx::test::error_of;
using namespace ddpx::test::ps_util;

class PsOptimizer : public ::testing::TestWithParam<std::string> {};

// One worker, every other rank a server (np 3, 4: tensors split).
TEST_P(PsOptimizer, OneWorkerEqualsLocalTraining) {
  const int servers = world_size() - 1;
  const int64_t steps = 25;
  for (const std::string c : {"async", "ssp:0", "sync"}) {
    const auto got = run_ps(options(servers, c, GetParam()), steps);
    auto ref = make_params();
    auto opt = make_opt(GetParam(), ref);
    for (int64_t s = 0; s < steps; ++s) {
      compute_grads(ref, 0, s);
      set_lr(*opt, lr_at(s));
      opt->step();
    }
    SCOPED_TRACE(c);
    expect_bitwise(got.params, ref);
    EXPECT_EQ(got.stats.version, steps);
    EXPECT_EQ(got.stats.staleness.max(), 0);
  }
}
INSTANTIATE_TEST_SUITE_P(Ps, PsOptimizer, ::testing::Values("sgd", "adam"));

// Prefetch: the next parameters are requested as soon as a step's are in,
// before its push, so step s computes on the parameters after push s - 2:
// one worker is exactly one version stale (the first push excepted).
TEST(Ps, OneWorkerPrefetchIsOneStepStale) {
  auto o = options(world_size() - 1, "async");
  o.pull = ps::PullMode::Prefetch;
  const int64_t steps = 20;
  const auto got = run_ps(o, steps);
  auto ref = make_params();
  auto opt = make_opt("sgd", ref);
  auto seen = clone_params(ref);  // what the worker computes on
  auto scratch = clone_params(ref);
  for (int64_t s = 0; s < steps; ++s) {
    copy_params(scratch, seen);
    copy_params(seen, ref);  // the prefetch of step s + 1 sees version s
    compute_grads(scratch, 0, s);
    for (size_t i = 0; i < ref.size(); ++i) ref[i].mutable_grad() = scratch[i].grad();
    set_lr(*opt, lr_at(s));
    opt->step();
  }
  expect_bitwise(got.params, ref);
  EXPECT_EQ(got.stats.staleness.max(), 1);
  EXPECT_EQ(got.stats.staleness.counts.at(0), world_size() - 1);  // the first push, per server
}

// Inconsistent reads (AsySG-InCon): pull() never waits after the first, so
// which versions a step mixes depends on timing. What holds whatever the
// timing: every push is applied once, and no push but the first is computed
// on parameters that include the worker's previous push (the pull whose reply
// a step uses was asked for before that push was sent, and a server answers
// in arrival order), so exactly one push per server is 0 versions stale.
TEST(Ps, InconsistentReadsNeverIncludeTheWorkersLastPush) {
  const int servers = world_size() == 2 ? 1 : 2;
  if (world_size() - servers != 1) GTEST_SKIP() << "one worker: np 2 or 3";
  auto o = options(servers, "async");
  o.pull = ps::PullMode::Inconsistent;
  const int64_t steps = 40;
  const auto got = run_ps(o, steps, [](int, int64_t s) {
    if (s % 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  EXPECT_EQ(got.stats.applied, servers * steps);
  EXPECT_EQ(got.stats.staleness.counts.at(0), servers);
  EXPECT_GE(got.stats.staleness.mean(), 1.0 - 1.0 / steps);
  for (size_t i = 0; i < got.params.size(); ++i) {
    EXPECT_TRUE(at::isfinite(got.params[i]).all().item<bool>());
    EXPECT_FALSE(at::equal(got.params[i], make_params()[i])) << "parameter " << i << " never moved";
  }
}

// np 3: 1 server, 2 workers; np 4: 2 servers (a split tensor), 2 workers.
// Random delays scramble the arrival order; the result must not change.
// And with delay compensation (DC-ASGD): bitwise the sequential application
// with g + lambda * g * g * (w_now - w_base), w_base the parameters each
// worker computed on -- which the server never holds; the workers send
// g * g * w_base. It is not a no-op.
TEST(Ps, DeterministicEqualsSequentialApplication) {
  const int n = world_size();
  if (n < 3) GTEST_SKIP() << "needs two workers";
  const int servers = n == 3 ? 1 : 2;
  const int workers = n - servers;
  for (const double dc : {0.0, 2.0}) {
    SCOPED_TRACE(::testing::Message() << "delay_comp " << dc);
    auto o = options(servers, "async");
    o.deterministic = true;
    o.delay_comp = dc;
    o.max_push_delay_us = 2000;
    const int64_t steps = 15;
    const auto got = run_ps(o, steps);
    const auto want = sequential_round_robin(workers, steps, false, dc);
    expect_bitwise(got.params, want);
    if (dc == 0) continue;
    EXPECT_FALSE(at::equal(want[0], sequential_round_robin(workers, steps)[0]));
    // Every push carried g * g * w_base: 4 more bytes per element.
    const int64_t per_push = servers * static_cast<int64_t>(sizeof(ps::detail::PushHeader)) +
                             8 * static_cast<int64_t>(servers == 1 ? 4 : 5) + 2 * 4 * 120;
    EXPECT_EQ(got.stats.bytes_received, workers * steps * per_push);
  }
}

// The same with the staleness-aware rate: np 3 has 2 workers (tau <= 1, the
// rate never changes), np 4 with 1 server has 3 (tau = 2 from the second
// round on: lr / 2).
TEST(Ps, StalenessAwareRateEqualsSequentialApplication) {
  const int n = world_size();
  if (n < 3) GTEST_SKIP() << "needs two workers";
  const int workers = n - 1;
  auto o = options(1, "async");
  o.deterministic = true;
  o.staleness_lr = true;
  o.max_push_delay_us = 1000;
  const int64_t steps = 12;
  const auto got = run_ps(o, steps);
  const auto want = sequential_round_robin(workers, steps, /*staleness_lr=*/true);
  expect_bitwise(got.params, want);
  if (workers > 2) {
    // And it is not the plain rate's result.
    EXPECT_FALSE(at::equal(want[0], sequential_round_robin(workers, steps)[0]));
  }
}

// sync with n = N: every update is the mean of the N gradients computed on
// the same parameters (summed in worker order) -- synchronous data-parallel
// SGD, bitwise.
TEST(Ps, SyncEqualsDataParallel) {
  const int n = world_size();
  const int servers = n == 4 ? 2 : 1;
  const int workers = n - servers;
  const int64_t steps = 12;
  auto o = options(servers, "sync");
  o.max_push_delay_us = 1000;
  const auto got = run_ps(o, steps);
  auto ref = make_params();
  auto opt = make_opt("sgd", ref);
  auto scratch = clone_params(ref);
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<at::Tensor> sum;
    for (int w = 0; w < workers; ++w) {
      copy_params(scratch, ref);
      compute_grads(scratch, w, s);
      for (size_t i = 0; i < ref.size(); ++i) {
        if (w == 0)
          sum.push_back(scratch[i].grad().clone());
        else
          sum[i].add_(scratch[i].grad());
      }
    }
    for (size_t i = 0; i < ref.size(); ++i) {
      ref[i].mutable_grad() = workers > 1 ? sum[i].div_(double(workers)) : sum[i];
    }
    set_lr(*opt, lr_at(s));
    opt->step();
  }
  expect_bitwise(got.params, ref);
  EXPECT_EQ(got.stats.version, steps);
  EXPECT_EQ(got.stats.applied, servers * workers * steps);
  EXPECT_EQ(got.stats.staleness.max(), 0);
}

// sync:n with n < N (backup workers): each update takes the first n
// gradients on the current version and drops the late ones; nothing stale is
// ever applied, and every push is either applied or dropped.
TEST(Ps, SyncQuorumDropsLatePushes) {
  const int n = world_size();
  if (n < 3) GTEST_SKIP() << "needs two workers";
  const int workers = n - 1;
  const int64_t steps = 20;
  std::mt19937 rng(11 + n);
  const auto got = run_ps(options(1, "sync:1"), steps, [&](int w, int64_t) {
    if (w == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
  });
  EXPECT_EQ(got.stats.applied + got.stats.dropped, workers * steps);
  EXPECT_EQ(got.stats.updates, got.stats.applied);  // one gradient per update
  EXPECT_GT(got.stats.dropped, 0);
  EXPECT_EQ(got.stats.staleness.max(), 0);
}

// ssp:S with one server and 2 or 3 workers (expect_ssp_bounds).
TEST(Ps, SspHoldsEachWorkerWithinSStepsOfTheSlowest) {
  const int n = world_size();
  if (n < 3) GTEST_SKIP() << "needs two workers";
  expect_ssp_bounds(1, n - 1);
}

// N workers of equal speed (a 2 ms step each): each gradient is applied after
// the N - 1 others' on average.
TEST(Ps, AsyncMeanStalenessNearWorkersMinusOne) {
  const int n = world_size();
  if (n < 3) GTEST_SKIP() << "needs two workers";
  const int workers = n - 1;
  const auto got = run_ps(options(1, "async"), 60, [](int, int64_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  });
  EXPECT_EQ(got.stats.applied, workers * 60);
  EXPECT_NEAR(got.stats.staleness.mean(), workers - 1, 0.35)
      << "p50 " << got.stats.staleness.percentile(0.5) << " max " << got.stats.staleness.max();
}

// A run stopped after 8 of 12 steps and restored from the servers'
// checkpoints ends bitwise where the uninterrupted run ends (sync: every
// worker's next gradient is computed on the saved version). The checkpoint
// of step 4 is taken too, so "the last one wins" is what is checked. With a
// lossy push codec each worker restores its residuals too (saved after
// pushes 4 and 8: the step-4 ones do not match and are refused); without
// them int8 would not end there (the test's control).
TEST(Ps, ResumeEqualsUninterrupted) {
  const int n = world_size();
  const int servers = n == 4 ? 2 : 1;
  std::string none_at8;  // a worker's bytes of the codec-"none" run
  for (const std::string codec : {"none", "int8"}) {
    SCOPED_TRACE(codec);
    auto with_codec = [&] {
      auto o = options(servers, "sync");
      o.codec = codec;
      return o;
    };
    const auto whole = run_ps(with_codec(), 12);
    std::string state, at4, at8;
    int saves = 0;
    auto o = with_codec();
    o.checkpoint_every = 4;
    o.on_checkpoint = [&](const std::string& bytes) {
      state = bytes;
      ++saves;
    };
    run_ps(o, 8, {}, "", [&](ps::Worker& w) {
      if (w.stats().pushes == 4) at4 = w.save_residuals();
      if (w.stats().pushes == 8) at8 = w.save_residuals();
    });
    const bool server = ddpx::comm::detail::MpiEnv::get().world_rank() < servers;
    if (server) EXPECT_EQ(saves, 3);  // after updates 4 and 8, and at the end
    const auto resumed = run_ps(with_codec(), 12, {}, state, {}, [&](ps::Worker& w) {
      EXPECT_EQ(w.start_step(), 8);
      EXPECT_FALSE(w.restore_residuals(at4)) << "residuals of step 4 taken at step 8";
      EXPECT_TRUE(w.restore_residuals(at8));
    });
    if (codec == "none") none_at8 = at8;
    expect_bitwise(resumed.params, whole.params);
    EXPECT_EQ(resumed.stats.version, 12);
    EXPECT_EQ(resumed.stats.applied, whole.stats.applied);
    if (codec == "int8") {
      const auto without = run_ps(with_codec(), 12, {}, state, {}, [&](ps::Worker& w) {
        const std::string err = error_of([&] { w.restore_residuals(none_at8); });
        EXPECT_NE(err.find("saved with push codec 'none'; this run pushes with 'int8'"),
                  std::string::npos) << err;
      });
      bool same = true;
      for (size_t i = 0; i < without.params.size(); ++i) {
        same = same && at::equal(without.params[i], whole.params[i]);
      }
      EXPECT_FALSE(same) << "dropping the residuals changed nothing: the test proves nothing";
    }
  }
}

// Every push codec, 2 servers (the first weight split between them) and one
// worker: equals local SGD on the decoded gradients, with the worker's error
// feedback kept per (server, segment) as the worker keeps it.
class PsCodec : public ::testing::TestWithParam<std::string> {};
TEST_P(PsCodec, TwoServersSplitTensor) {
  if (world_size() != 3) GTEST_SKIP() << "2 servers + 1 worker: np 3";
  const int64_t steps = 20;
  auto o = options(2, "async");
  o.codec = GetParam();
  const auto got = run_ps(o, steps);
  const auto codec = ddpx::comm::MessageCodec::parse(GetParam());
  auto ref = make_params();
  const auto layout = ps::detail::Layout::plan({65, 13, 39, 3}, 2);
  std::map<std::pair<int, size_t>, at::Tensor> residual;
  auto opt = make_opt("sgd", ref);
  for (int64_t s = 0; s < steps; ++s) {
    compute_grads(ref, 0, s);
    std::vector<at::Tensor> decoded;
    for (const auto& p : ref) decoded.push_back(at::empty({p.numel()}, at::kFloat));
    for (int k = 0; k < 2; ++k) {
      for (size_t i = 0; i < layout.shards[k].size(); ++i) {
        const auto& sg = layout.shards[k][i];
        const at::Tensor x =
            ref[sg.param].grad().reshape(-1).narrow(0, sg.offset, sg.numel).contiguous();
        at::Tensor& e = residual[{k, i}];
        if (!e.defined()) e = at::zeros_like(x);
        decoded[sg.param]
            .narrow(0, sg.offset, sg.numel)
            .copy_(codec.decode(codec.encode(x, e), sg.numel));
      }
    }
    for (size_t i = 0; i < ref.size(); ++i) ref[i].mutable_grad() = decoded[i].view(ref[i].sizes());
    set_lr(*opt, lr_at(s));
    opt->step();
  }
  expect_bitwise(got.params, ref);
  // Bytes on the wire, exactly: each segment's codec message, a header per
  // server and a length per segment, for every push.
  int64_t per_push = 2 * static_cast<int64_t>(sizeof(ps::detail::PushHeader));
  for (const auto& shard : layout.shards) {
    for (const auto& sg : shard) per_push += 8 + codec.message_bytes(sg.numel);
  }
  EXPECT_EQ(got.stats.bytes_received, steps * per_push);
  EXPECT_EQ(got.stats.bytes_raw, steps * 4 * 120);
}
INSTANTIATE_TEST_SUITE_P(Ps, PsCodec,
                         ::testing::Values("none", "fp16", "bf16", "int8:16", "topk:0.3"),
                         codec_test_name);

// Pulls through a codec, one worker, every other rank a server (np 3, 4:
// tensors split, one delta message per shard): the worker computes on what
// the deltas built, and the result equals local training where the gradient
// is taken on that copy and the copy follows the parameters by the decoded
// difference of each shard after each update -- the servers' parameters and
// the worker's copy, both bit for bit. The first reply is exact; the bytes
// are each shard's message per pull.
class PsPullCodec : public ::testing::TestWithParam<std::string> {};
TEST_P(PsPullCodec, OneWorkerEqualsLocalTrainingOnTheDecodedCopy) {
  const int servers = world_size() - 1;
  const int64_t steps = 25;
  auto o = options(servers, "async");
  o.pull_codec = GetParam();
  const auto got = run_ps(o, steps);
  const auto codec = ddpx::comm::MessageCodec::parse(GetParam());
  const auto layout = ps::detail::Layout::plan({65, 13, 39, 3}, servers);
  auto ref = make_params();
  auto copy = clone_params(ref);  // what the worker holds
  auto opt = make_opt("sgd", ref);
  auto flat = [](const std::vector<at::Tensor>& p) {
    std::vector<at::Tensor> parts;
    for (const auto& t : p) parts.push_back(t.detach().reshape(-1));
    return at::cat(parts);
  };
  for (int64_t s = 0; s < steps; ++s) {
    compute_grads(copy, 0, s);
    for (size_t i = 0; i < ref.size(); ++i) ref[i].mutable_grad() = copy[i].grad().clone();
    set_lr(*opt, lr_at(s));
    opt->step();
    const at::Tensor want = flat(ref);
    at::Tensor have = flat(copy);
    int64_t off = 0;
    for (int k = 0; k < servers; ++k) {
      const int64_t n = layout.shard_numel[k];
      at::Tensor h = have.narrow(0, off, n);
      h.add_(codec.decode(codec.encode(want.narrow(0, off, n) - h, at::Tensor()), n));
      off += n;
    }
    at::NoGradGuard no_grad;
    off = 0;
    for (auto& t : copy) {
      t.copy_(have.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
  expect_bitwise(got.params, ref);
  if (ddpx::comm::detail::MpiEnv::get().world_rank() != servers) return;  // the worker's own
  expect_bitwise(got.held, copy);
  EXPECT_FALSE(at::equal(flat(got.held), flat(got.params))) << "the pulls lost nothing";
  int64_t bytes = 0;
  for (int64_t n : layout.shard_numel) bytes += 4 * n + steps * codec.message_bytes(n);
  EXPECT_EQ(got.worker.pulls, (steps + 1) * servers);
  EXPECT_EQ(got.worker.pull_bytes, bytes);
  EXPECT_EQ(got.worker.pull_bytes_raw, (steps + 1) * 4 * 120);
}
INSTANTIATE_TEST_SUITE_P(Ps, PsPullCodec, ::testing::Values("fp16", "bf16", "int8:16", "topk:0.3"),
                         codec_test_name);

TEST(PsErrors, BadOptionsNameTheArgument) {
  const int n = world_size();
  auto o = options(n, "async");
  EXPECT_NE(error_of([&] { ps::Session(make_params(), o); }).find("--servers must be in [1, "),
            std::string::npos);
  o = options(1, "eventually");
  EXPECT_NE(
      error_of([&] { ps::Session(make_params(), o); }).find("unknown consistency 'eventually'"),
      std::string::npos);
  o = options(1, "async");
  o.codec = "gzip";
  EXPECT_NE(error_of([&] { ps::Session(make_params(), o); }).find("unknown codec 'gzip'"),
            std::string::npos);
  o.codec = "none";
  o.pull_codec = "powersgd:2";
  const auto pull = error_of([&] { ps::Session(make_params(), o); });
  EXPECT_NE(pull.find("pull codec: "), std::string::npos) << pull;
  EXPECT_NE(pull.find("no point-to-point form"), std::string::npos) << pull;
  o = options(1, "sync");
  o.delay_comp = 0.5;
  EXPECT_NE(error_of([&] { ps::Session(make_params(), o); }).find("would do nothing"),
            std::string::npos);
  o = options(1, "async");
  o.delay_comp = -1;
  EXPECT_NE(error_of([&] { ps::Session(make_params(), o); }).find("delay_comp (DC-ASGD's lambda)"),
            std::string::npos);
}

TEST(PsErrors, ModelMismatchAcrossRanks) {
  auto params = make_params();
  if (ddpx::comm::detail::MpiEnv::get().world_rank() == 1) params.pop_back();
  const auto err = error_of([&] { ps::Session(params, options(1, "async")); });
  EXPECT_NE(err.find("disagree on the parameter count, parameter shapes"), std::string::npos)
      << err;
  // It names the first rank that differs and what it and rank 0 have.
  const auto p = make_params();
  std::ostringstream all, less;
  all << p.size() << " parameters ";
  less << (p.size() - 1) << " parameters ";
  EXPECT_NE(err.find("rank 0 has " + all.str()), std::string::npos) << err;
  EXPECT_NE(err.find("; rank 1 has " + less.str()), std::string::npos) << err;
  EXPECT_EQ(err.find(";,"), std::string::npos) << err;
}

// A worker sends a push whose segment length is wrong, then one computed on
// a version the server never had: each is refused with an error naming it,
// and the worker's pull fails with that error.
TEST(PsErrors, WrongMessagesAreRefused) {
  for (int variant = 0; variant < 2; ++variant) {
    auto params = make_params();
    ps::Session session(params, options(1, "async"));
    if (session.is_server()) {
      const auto st = ps::Server(session).serve();
      EXPECT_EQ(st.applied, 0);
      EXPECT_EQ(st.workers_lost, session.num_workers());
    } else {
      const int w = session.rank() - 1;
      ps::detail::PushHeader h;
      h.worker = w;
      h.flags = ps::detail::kAfterPush;
      std::vector<at::Tensor> payloads;
      for (const auto& sg : session.state().layout.shards[0]) {
        payloads.push_back(at::zeros({4 * sg.numel}, at::kByte));
      }
      if (variant == 0)
        payloads[1] = at::zeros({3}, at::kByte);
      else
        h.base = 999;
      const at::Tensor msg = ps::detail::pack_push(h, payloads);
      MPI_Send(msg.data_ptr(), static_cast<int>(msg.numel()), MPI_BYTE, 0, ps::detail::kPush,
               session.state().comm);
      ps::Worker worker(session);
      const auto err = error_of([&] { worker.pull(); });
      if (variant == 0) {
        EXPECT_NE(err.find("has 3 bytes for segment 1 of 13 elements; expected 52"),
                  std::string::npos)
            << err;
      } else {
        EXPECT_NE(err.find("computed on version 999"), std::string::npos) << err;
      }
      EXPECT_NE(err.find("refused worker"), std::string::npos) << err;
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

}  // namespace
