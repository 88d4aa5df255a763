// GradSyncOptions::shard (ZeRO-1/2), mpirun with 2 and 3 ranks, on the
// torch::nn model of the overlap tests (unused experts, two param groups, a
// learning-rate schedule): a sharded run leaves the parameters where the
// unsharded synchronous one does (GradSync, then optimizer.step()) -- bit
// for bit: the reductions divide and then sum the same values, and a sum of
// two (2 ranks) or three (Open MPI's reduce and all-reduce add in rank
// order on a few ranks) comes out the same -- in every overlap mode, with
// Unused::Exact, no_sync accumulation and a checkpoint resumed midway; the
// codecs, clipping, mixed dtypes, Gloo's all-to-all, and the step during
// backward. Who owns what and the memory it keeps, and the misuses:
// test_grad_sync_shard_state.cpp; checkpoints: test_grad_sync_shard_checkpoint.cpp.
#include <ATen/CPUGeneratorImpl.h>
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "grad_sync_train_harness.h"
#include "plugin/comm/flight_recorder.h"

namespace {

using namespace ddpx_overlap_test;
using ddpx::Shard;
using ddpx::test::all_bytes;

TrainRun sharded(Shard s, Overlap o, Opt opt, Unused u = Unused::Predict, int micro = 1,
                 int resume_at = -1) {
  TrainRun r = with(o, opt, u, micro, "none", resume_at);
  r.shard = s;
  r.steps = 130;  // (past both changes of the learning rate)
  return r;
}

// The codecs' sharded forms against the same codec unsharded, on the model
// with both experts used every step: bit for bit for fp16 and bf16. (With
// parameters no rank used, the runs part in the last bits: below.)
TrainRun sharded(Shard s, Overlap o, Opt opt, const char* codec, Unused u = Unused::Predict,
                 int micro = 1) {
  TrainRun r = sharded(s, o, opt, u, micro);
  r.codec = codec;
  r.every_param_used = true;
  return r;
}

class GradSyncShard : public ::testing::TestWithParam<Case> {};

TEST_P(GradSyncShard, BitwiseEqualToUnsharded) {
  expect_same_as_synchronous(GetParam().run, GetParam().name);
}

const Case kCases[] = {
    {"OptimizerStateNoOverlapSgd", sharded(Shard::Optimizer, Overlap::None, Opt::SgdNesterov)},
    {"OptimizerStateAdamW", sharded(Shard::Optimizer, Overlap::Optimizer, Opt::AdamW)},
    {"OptimizerStateNextForwardExact",
     sharded(Shard::Optimizer, Overlap::NextForward, Opt::Adam, Unused::Exact)},
    {"OptimizerStateNoSync",
     sharded(Shard::Optimizer, Overlap::None, Opt::AdamW, Unused::Predict, 2)},
    {"GradientsNoOverlapAdam", sharded(Shard::Gradients, Overlap::None, Opt::Adam)},
    {"GradientsNextForwardNoSync",
     sharded(Shard::Gradients, Overlap::NextForward, Opt::SgdNesterov, Unused::Predict, 3)},
    {"GradientsResumedAdamW",
     sharded(Shard::Gradients, Overlap::Optimizer, Opt::AdamW, Unused::Predict, 1, 70)},
    {"OptimizerStateResumedSgd",
     sharded(Shard::Optimizer, Overlap::NextForward, Opt::SgdNesterov, Unused::Predict, 1, 45)},
    // fp16/bf16: the unsharded codec's run, bit for bit (codec_scatter_test.cpp).
    {"Fp16OptimizerStateAdamW", sharded(Shard::Optimizer, Overlap::Optimizer, Opt::AdamW, "fp16")},
    {"Bf16GradientsNextForwardNoSync",
     sharded(Shard::Gradients, Overlap::NextForward, Opt::SgdNesterov, "bf16", Unused::Predict, 2)},
    {"Fp16GradientsExact",
     sharded(Shard::Gradients, Overlap::None, Opt::Adam, "fp16", Unused::Exact)},
    // Unused::Off: stepped and gathered during backward without the
    // per-bucket agreement on use (the Predict cases above have it).
    {"GradientsUnusedOffAdam",
     sharded(Shard::Gradients, Overlap::Optimizer, Opt::Adam, "none", Unused::Off)},
};

INSTANTIATE_TEST_SUITE_P(Modes, GradSyncShard, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// With parameters no rank used (an expert every other step): their slots go
// out in a reliable bucket, carrying each rank's residual for them, and the
// mean nobody steps is owed again -- unsharded by every rank, sharded by
// the owner alone, world times over (only it has the mean): the same sum of
// residuals, rounded otherwise; int8 also cuts its chunks at the owners'
// bounds (codec_scatter_test.cpp). So the runs part by roundings of the
// codec's own size: the sharded run stays as close to the unsharded codec's
// as that one is to the exact run (Adam: a rounding moves a step fully).
TEST(GradSyncShardCodecs, WithUnusedParametersStayNextToTheUnshardedCodec) {
  struct C {
    const char* codec;
    Shard shard;
    Overlap overlap;
  };
  for (const C& c : {C{"fp16", Shard::Optimizer, Overlap::NextForward},
                     C{"int8", Shard::Gradients, Overlap::Optimizer}}) {
    TrainRun ours = sharded(Shard::None, Overlap::None, Opt::Adam);
    ours.codec = c.codec;
    ours.steps = 40;
    TrainRun ref = ours, exact = ours;
    ours.shard = c.shard;
    ours.overlap = c.overlap;
    exact.codec = "none";
    const auto got = train(ours), want = train(ref), none = train(exact);
    double off = 0, codec_error = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      off = std::max(off, (got[i] - want[i]).abs().max().item<double>());
      codec_error = std::max(codec_error, (none[i] - want[i]).abs().max().item<double>());
    }
    EXPECT_GT(off, 0.0) << c.codec << ": the same bits; the case tests nothing";
    EXPECT_LE(off, 1.5 * codec_error) << c.codec;
  }
}

// Global-norm clipping (GradSyncOptions::clip_grad_norm) against LibTorch's
// clip_grad_norm_ after backward: bit for bit unsharded (its own code runs
// on the averages), within rounding sharded (the norm sums every rank's
// parts in another order); a limit low enough to clip most steps.
TEST(GradSyncShardClip, ClipsTheGlobalNormOverEveryRanksParts) {
  for (Shard s : {Shard::None, Shard::Gradients}) {
    TrainRun ours = sharded(s, s == Shard::None ? Overlap::Optimizer : Overlap::NextForward,
                            Opt::AdamW);
    ours.clip = 0.05;
    TrainRun ref = ours;
    ref.overlap = Overlap::None;
    ref.shard = Shard::None;
    const auto want = train(ref), got = train(ours);
    TrainRun unclipped = ref;
    unclipped.clip = 0;
    EXPECT_FALSE(at::allclose(train(unclipped)[0], want[0])) << "the limit never clipped";
    for (size_t i = 0; i < want.size(); ++i) {
      if (s == Shard::None) {
        EXPECT_TRUE(at::equal(got[i], want[i])) << "parameter " << i;
      } else {
        EXPECT_TRUE(at::allclose(got[i], want[i], 1e-10, 1e-12))
            << "parameter " << i << " differs by " << (got[i] - want[i]).abs().max().item<double>();
      }
    }
  }
}

// Float64 and float32 parameters in one model, a frozen layer between them
// (not synced, not sharded, yet held by the optimizer, as a trainer's
// optimizer over model->parameters() holds it), and buckets that mix the
// dtypes' byte ranges: the sharded runs (and the unsharded one GradSync
// steps) leave the parameters bit for bit where the unsharded synchronous
// one does, the frozen layer untouched.
struct MixedImpl : torch::nn::Module {
  torch::nn::Linear in{nullptr}, frozen{nullptr}, out{nullptr};
  MixedImpl() {
    in = register_module("in", torch::nn::Linear(6, 10));
    frozen = register_module("frozen", torch::nn::Linear(10, 10));
    out = register_module("out", torch::nn::Linear(10, 3));
    in->to(at::kDouble);
    frozen->to(at::kDouble);
    for (auto& p : frozen->parameters()) p.requires_grad_(false);
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::tanh(frozen(torch::tanh(in(x))));
    return out(h.to(at::kFloat)).pow(2).mean();
  }
};
TORCH_MODULE(Mixed);

std::vector<at::Tensor> train_mixed(Shard s, Overlap o) {
  auto& pg = world();
  torch::manual_seed(11);
  Mixed m;
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(0.01).weight_decay(1e-3));
  GradSync sync(m->named_parameters(), pg,
                GradSyncOptions().shard(s).overlap(o).bucket_cap_mb(0.0002).first_bucket_mb(0.0001));
  const bool by_sync = s != Shard::None || o != Overlap::None;
  if (by_sync) sync.set_optimizer(opt);
  for (int step = 0; step < 25; ++step) {
    if (!by_sync) opt.zero_grad();
    m->forward(shard(global_batch(6, 700 + step), pg->getRank())).backward();
    if (!by_sync) opt.step();
  }
  sync.synchronize();
  std::vector<at::Tensor> out;
  for (const auto& p : m->parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST(GradSyncShardMixed, DtypesAndAFrozenLayerAsUnsharded) {
  const auto want = train_mixed(Shard::None, Overlap::None);
  torch::manual_seed(11);
  Mixed init;
  EXPECT_TRUE(at::equal(want[2], init->frozen->weight)) << "the frozen layer moved";
  EXPECT_FALSE(at::equal(want[0], init->in->weight)) << "the reference did not train";
  for (Shard s : {Shard::None, Shard::Optimizer, Shard::Gradients}) {
    for (Overlap o : {Overlap::None, Overlap::Optimizer}) {
      if (s == Shard::None && o == Overlap::None) continue;  // (the reference)
      expect_bitwise(train_mixed(s, o), want,
                     std::string(s == Shard::None        ? "unsharded"
                                 : s == Shard::Optimizer ? "optimizer"
                                                         : "gradients") +
                         (o == Overlap::None ? " / none" : " / optimizer"));
    }
  }
}

// Over Gloo the exact reduction to the owners is an all-to-all in pieces of
// 2 MiB of each part (grad_sync_shard.cpp): a layer of 1.6M weights (two
// pieces a part on 2 and on 3 ranks, the parts cutting it), ZeRO-1 and ZeRO-2
// with Overlap None and Optimizer, against the unsharded run over the same
// group: with Adam bit for bit on 2 ranks (one add per element either way);
// beyond, the owner adds in rank order and Gloo's ring in its own, so the
// averages differ by roundings, which Adam's m / sqrt(v) can blow up to lr
// near a zero gradient: within 1e-6 with SGD there.
std::vector<at::Tensor> train_wide(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, Shard s,
                                   Overlap o) {
  const int rank = pg->getRank(), world = pg->getSize();
  torch::manual_seed(5);
  torch::nn::Sequential m(torch::nn::Linear(1024, 1600), torch::nn::Tanh(),
                          torch::nn::Linear(1600, 3));
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (world == 2) {
    opt = std::make_unique<torch::optim::Adam>(m->parameters(), torch::optim::AdamOptions(1e-3));
  } else {
    opt = std::make_unique<torch::optim::SGD>(m->parameters(), torch::optim::SGDOptions(0.1));
  }
  GradSync sync(m->named_parameters(), pg, GradSyncOptions().shard(s).overlap(o));
  const bool by_sync = s != Shard::None || o != Overlap::None;
  if (by_sync) sync.set_optimizer(*opt);
  for (int step = 0; step < 3; ++step) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(40 + step);
    const at::Tensor x = at::randn({2 * world, 1024}, g).narrow(0, 2 * rank, 2);
    if (!by_sync) opt->zero_grad();
    m->forward(x).pow(2).mean().backward();
    if (!by_sync) opt->step();
  }
  sync.synchronize();
  std::vector<at::Tensor> out;
  for (const auto& p : m->parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST(GradSyncShardGloo, AllToAllInPiecesAsUnsharded) {
  ddpx::comm::MakeOptions mo;
  mo.name = "shard_gloo";
  const auto gloo = ddpx::comm::make("gloo", mo);
  const auto want = train_wide(gloo, Shard::None, Overlap::None);
  for (Shard s : {Shard::Optimizer, Shard::Gradients}) {
    for (Overlap o : {Overlap::None, Overlap::Optimizer}) {
      const std::string what = std::string(s == Shard::Optimizer ? "optimizer" : "gradients") +
                               (o == Overlap::None ? " / none" : " / optimizer");
      const auto got = train_wide(gloo, s, o);
      if (gloo->getSize() == 2) {
        expect_bitwise(got, want, what);
        continue;
      }
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_LE((got[i] - want[i]).abs().max().item<double>(), 1e-6) << what << " " << i;
      }
    }
  }
}

// Stepped during backward (Overlap None and Optimizer), an owner steps
// whatever some rank used: under Unused::Predict the ranks' use of the
// bucket's parameters is agreed in front of its reduction. At step 4 the
// last rank skips the second layer, planned with the used ones until then
// (a misprediction), whose last elements that rank owns: they must be
// stepped with the others' average, as in the unsharded run.
struct TwoLayersImpl : torch::nn::Module {
  TwoLayersImpl()
      : a(register_module("a", torch::nn::Linear(6, 5))),
        b(register_module("b", torch::nn::Linear(5, 4))) {}
  torch::nn::Linear a, b;
};
TORCH_MODULE(TwoLayers);

std::vector<at::Tensor> train_skipping(Shard s, Overlap o) {
  auto& pg = world();
  const int rank = pg->getRank(), last = pg->getSize() - 1;
  torch::manual_seed(9);
  TwoLayers m;
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
  GradSync sync(m->named_parameters(), pg, GradSyncOptions().shard(s).overlap(o));
  const bool by_sync = s != Shard::None;
  if (by_sync) sync.set_optimizer(opt);
  for (int step = 0; step < 6; ++step) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(70 + step);
    const at::Tensor x = at::randn({4 * (last + 1), 6}, g).narrow(0, 4 * rank, 4);
    if (!by_sync) opt.zero_grad();
    at::Tensor y = m->a(x).tanh();
    if (!(rank == last && step == 4)) y = m->b(y);
    y.pow(2).mean().backward();
    if (!by_sync) opt.step();
  }
  std::vector<at::Tensor> out;
  for (const auto& p : m->parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST(GradSyncShardEarlyStep, StepsWhatAnotherRankUsed) {
  const auto want = train_skipping(Shard::None, Overlap::None);
  for (Overlap o : {Overlap::None, Overlap::Optimizer}) {
    expect_bitwise(train_skipping(Shard::Optimizer, o), want,
                   o == Overlap::None ? "none" : "optimizer");
  }
}

// The flight recorder's view of the early step (on by default, 2000
// records): each bucket's used-flags all-reduce is a record of its own just
// before the bucket's reduce-scatter, and each gather follows the next
// bucket's reduction (R0 R1 G0 R2 G1 ...), all before the step-end
// agreement; the same sequence, numbered alike, on every rank.

TEST(GradSyncShardEarlyStep, FlightRecorderHasOneSequenceOnEveryRank) {
  using ddpx::comm::detail::FlightRecorder;
  using ddpx::comm::detail::FrOp;
  using ddpx::comm::detail::FrRecord;
  auto& fr = FlightRecorder::get();
  ASSERT_TRUE(fr.enabled()) << "needs the flight recorder (TORCH_FR_BUFFER_SIZE unset or > 0)";
  uint64_t before = 0;
  for (const auto& r : fr.snapshot().records) before = std::max(before, r.id);
  torch::manual_seed(9);
  TwoLayers m;
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
  GradSync sync(m->named_parameters(), world(),
                GradSyncOptions()
                    .shard(Shard::Optimizer)
                    .overlap(Overlap::Optimizer)
                    .bucket_cap_mb(1e-4)
                    .first_bucket_mb(1e-4));
  sync.set_optimizer(opt);
  for (int step = 0; step < 3; ++step) m->b(m->a(at::randn({4, 6})).tanh()).pow(2).sum().backward();
  const auto plan = sync.bucket_plan();
  ASSERT_GE(plan.size(), 3u);
  const auto snap = fr.snapshot();
  std::vector<FrRecord> recs;
  for (const auto& r : snap.records) {
    if (r.id > before && snap.groups[r.group].lib == "gradsync") recs.push_back(r);
  }
  std::ostringstream all;
  for (size_t i = 0; i < recs.size(); ++i) {
    const auto& r = recs[i];
    EXPECT_EQ(r.collective_seq, recs[0].collective_seq + i) << "record " << i;
    all << r.step << ' ' << static_cast<int>(r.op) << ' ' << r.bucket << ' '
        << r.input_sizes.at(0).at(0) << ' ' << r.collective_seq << '\n';
  }
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<const FrRecord*> s;
    for (const auto& r : recs) {
      if (r.step == step) s.push_back(&r);
    }
    ASSERT_EQ(s.size(), 3 * plan.size() + 1);
    // F R for the first bucket, then per bucket F R G(previous), a last G,
    // the agreement (bucket -1).
    std::vector<int> order;  // the buckets in their reductions' order
    for (const auto* r : s) {
      if (r->op == FrOp::kReduceScatter) order.push_back(r->bucket);
    }
    ASSERT_EQ(order.size(), plan.size());
    size_t at = 0;
    for (size_t i = 0; i <= order.size(); ++i) {
      if (i < order.size()) {
        const int b = order[i];
        EXPECT_EQ(s[at]->op, FrOp::kAllReduce);
        EXPECT_EQ(s[at]->bucket, b);
        EXPECT_EQ(s[at]->input_sizes.at(0).at(0), static_cast<int64_t>(plan[b].size()));
        EXPECT_EQ(s[at]->input_dtypes.at(0), at::kInt);
        EXPECT_EQ(s[at + 1]->bucket, b);  // (its reduce-scatter)
        at += 2;
      }
      if (i > 0) {
        EXPECT_EQ(s[at]->op, FrOp::kAllGather);
        EXPECT_EQ(s[at]->bucket, order[i - 1]);
        ++at;
      }
    }
    EXPECT_EQ(s[at]->op, FrOp::kAllReduce);
    EXPECT_EQ(s[at]->bucket, -1);
  }
  for (const auto& other : all_bytes(*world(), all.str())) EXPECT_EQ(other, all.str());
}

}  // namespace
