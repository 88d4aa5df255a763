// GradSyncOptions::shard (ZeRO-1/2), mpirun with 2 and 3 ranks, on the
// torch::nn model of the overlap tests (unused experts, two param groups, a
// learning-rate schedule): a sharded run leaves the parameters where the
// unsharded synchronous one does (GradSync, then optimizer.step()) -- bit
// for bit: the reductions divide and then sum the same values, and a sum of
// two (2 ranks) or three (Open MPI's reduce and all-reduce add in rank
// order on a few ranks) comes out the same -- in every overlap mode, with
// Unused::Exact, no_sync accumulation and a checkpoint resumed midway;
// each rank keeps optimizer state for its own elements only; Gradients
// keeps no .grad and frees buckets as they are reduced; the misuses fail
// with errors that name both options.
#include <ATen/CPUGeneratorImpl.h>
#include <ddpx/comm.h>
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "grad_sync_train_harness.h"
#include "hooks/shard_map.h"
#include "plugin/comm/flight_recorder.h"

namespace {

using namespace ddpx_overlap_test;
using ddpx::Shard;
using ddpx::test::error_of;

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
std::vector<std::string> all_bytes(c10d::ProcessGroup& pg, const std::string& mine);  // (below)

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

// ---- who owns what ------------------------------------------------------------

TEST(ShardMap, CutsTheBytesIntoContiguousRangesAcrossTensorsAndDtypes) {
  using ddpx::hooks::ParamInfo;
  const c10::Device cpu(c10::kCPU);
  // 10 float32 + 7 float64 + 1 float16 + 33 float32 + 0 elements + 5 float64.
  const std::vector<ParamInfo> info{{10, at::kFloat, cpu}, {7, at::kDouble, cpu},
                                    {1, at::kHalf, cpu},   {33, at::kFloat, cpu},
                                    {0, at::kFloat, cpu},  {5, at::kDouble, cpu}};
  const int64_t total = 10 * 4 + 7 * 8 + 2 + 33 * 4 + 5 * 8;
  for (int world : {1, 2, 3, 5, 64}) {
    int64_t bytes_seen = 0;
    for (int r = 0; r < world; ++r) {
      ddpx::hooks::ShardMap m(info, world, r);
      EXPECT_EQ(m.total_bytes(), total);
      bytes_seen += m.owned_bytes();
      // Within one element (8 bytes at most) of an equal share.
      EXPECT_LE(std::abs(m.owned_bytes() * world - total), 8 * world) << world << " " << r;
    }
    EXPECT_EQ(bytes_seen, total) << world;
    ddpx::hooks::ShardMap m(info, world, 0);
    for (int p = 0; p < static_cast<int>(info.size()); ++p) {
      int64_t next = 0;  // the ranks' ranges tile the tensor, in rank order
      for (int r = 0; r < world; ++r) {
        const auto [lo, hi] = m.range(p, r);
        EXPECT_LE(lo, hi);
        if (lo == hi) continue;
        EXPECT_EQ(lo, next) << "world " << world << " param " << p << " rank " << r;
        next = hi;
      }
      EXPECT_EQ(next, info[p].numel) << "world " << world << " param " << p;
    }
    // A bucket of parameters 5, 1, 3 (as planned), laid out ascending:
    // each owner's elements are one run, the runs tile the bucket.
    std::vector<int> offset_of(info.size(), 0);
    offset_of[1] = 0, offset_of[3] = 7, offset_of[5] = 40;
    const auto parts = m.parts({5, 1, 3}, offset_of);
    int64_t at = 0;
    for (const auto& part : parts) {
      EXPECT_EQ(part.offset, at);
      EXPECT_GT(part.numel, 0);
      at += part.numel;
    }
    EXPECT_EQ(at, 45) << world;
  }
}

// Each rank keeps the optimizer's state for its own elements only: a flat
// slice per parameter, the size shard_range says, summing over the ranks
// to the whole model once; some tensor is cut between two ranks.
TEST(GradSyncShardState, EachRankKeepsStateForItsOwnElements) {
  auto& pg = world();
  torch::manual_seed(7);
  Gated m;
  torch::optim::Adam adam(m->parameters(), torch::optim::AdamOptions(0.01));
  GradSync sync(
      m->named_parameters(), pg,
      GradSyncOptions().shard(Shard::Optimizer).bucket_cap_mb(0.001).first_bucket_mb(0.0005));
  sync.set_optimizer(adam);
  for (int step = 0; step < 4; ++step) {
    m->forward(shard(global_batch(6, step), pg->getRank()), step).backward();
  }
  int64_t mine = 0, all = 0;
  bool cut = false;
  for (const auto& p : m->parameters()) {
    const auto [lo, hi] = sync.shard_range(p);
    all += p.numel();
    mine += hi - lo;
    cut = cut || (lo > 0 && lo < p.numel()) || (hi > 0 && hi < p.numel());
    auto it = adam.state().find(p.unsafeGetTensorImpl());
    if (lo == hi) {
      EXPECT_TRUE(it == adam.state().end()) << "state for a parameter this rank owns none of";
      continue;
    }
    ASSERT_TRUE(it != adam.state().end());
    const auto& st = static_cast<torch::optim::AdamParamState&>(*it->second);
    EXPECT_EQ(st.exp_avg().sizes(), at::IntArrayRef({hi - lo}));
    EXPECT_EQ(st.exp_avg_sq().numel(), hi - lo);
    EXPECT_TRUE(p.grad().defined()) << "Shard::Optimizer keeps .grad, its zeroed slot";
  }
  EXPECT_TRUE(cut) << "no tensor cut between ranks: the test model no longer tests that";
  std::vector<at::Tensor> t{at::full({1}, mine, at::kLong)};
  pg->allreduce(t)->wait();
  EXPECT_EQ(t[0].item<int64_t>(), all);
  const auto prof = sync.profile();
  EXPECT_EQ(prof.optimizer_state_bytes, 2.0 * 8 * static_cast<double>(mine));  // two moments
  EXPECT_EQ(prof.param_bytes, 8.0 * static_cast<double>(all));
  EXPECT_EQ(prof.grad_buffer_bytes, 8.0 * static_cast<double>(all));  // persistent buckets
  EXPECT_NE(sync.profile_summary().find("memory: optimizer state"), std::string::npos);
}

// Shard::Gradients: .grad is released once in its bucket and undefined
// after the step; buckets are freed as they are reduced, and a backward
// that runs ahead of the wire waits for it (make_room), so the gradient
// memory at its peak is this rank's part plus two buckets, not the model,
// however fast backward is: backward waits for room, and says so.
TEST(GradSyncShardState, GradientsHoldsItsPartAndTwoBuckets) {
  auto& pg = world();
  torch::manual_seed(5);
  constexpr int kLayers = 8, kWidth = 128;  // a bucket per layer: 64.5 KiB of float32
  torch::nn::Sequential seq;
  for (int i = 0; i < kLayers; ++i) seq->push_back(torch::nn::Linear(kWidth, kWidth));
  torch::optim::SGD sgd(seq->parameters(), torch::optim::SGDOptions(0.1));
  GradSync sync(
      seq->named_parameters(), pg,
      GradSyncOptions().shard(Shard::Gradients).bucket_cap_mb(0.07).first_bucket_mb(0.07));
  sync.set_optimizer(sgd);
  for (int step = 0; step < 3; ++step) {
    const at::Tensor loss = seq->forward(at::randn({2, kWidth})).pow(2).mean();
    // The other ranks start backward late: rank 0's first reductions cannot
    // end before they do, so its third bucket must wait for room (counted).
    if (pg->getRank() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(30));
    loss.backward();
    for (const auto& p : seq->parameters()) EXPECT_FALSE(p.grad().defined());
    if (pg->getRank() == 0) {
      EXPECT_GE(sync.last_step().memory_waits, 1) << "step " << step;
      EXPECT_GT(sync.last_step().memory_wait_us, 0) << "step " << step;
    }
  }
  ASSERT_EQ(sync.bucket_plan().size(), static_cast<size_t>(kLayers));
  const double bucket = 4.0 * kWidth * (kWidth + 1), model = kLayers * bucket;
  const auto prof = sync.profile();
  EXPECT_LE(prof.grad_buffer_bytes, model / pg->getSize() + 2 * bucket + 64)
      << "of a model of " << model << " bytes";
  EXPECT_GT(prof.grad_buffer_bytes, 0);
  if (pg->getRank() == 0) {
    EXPECT_GT(prof.memory_wait_us, 0);
    EXPECT_NE(sync.profile_summary().find("backward waiting for memory"), std::string::npos);
  }
}

// ---- checkpoints at any world size ---------------------------------------------

// A ddpx_mpi group of world ranks 0..n-1 (collective over them).
ddpx::comm::ProcessGroupPtr first_ranks(int n) {
  std::vector<int> ranks(n);
  std::iota(ranks.begin(), ranks.end(), 0);
  auto backend = ddpx::comm::make_mpi_backend(ranks);
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(c10::make_intrusive<c10d::HashStore>(),
                                                    world()->getRank(), n);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  return pg;
}

// Every rank's bytes, on every rank.
std::vector<std::string> all_bytes(c10d::ProcessGroup& pg, const std::string& mine) {
  std::vector<at::Tensor> size{at::full({pg.getSize()}, 0, at::kLong)};
  size[0][pg.getRank()] = static_cast<int64_t>(mine.size());
  pg.allreduce(size)->wait();
  const int64_t most = size[0].max().item<int64_t>();
  std::vector<at::Tensor> in{at::zeros({most}, at::kByte)};
  std::memcpy(in[0].data_ptr(), mine.data(), mine.size());
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < pg.getSize(); ++r) out[0].push_back(at::empty({most}, at::kByte));
  pg.allgather(out, in)->wait();
  std::vector<std::string> all;
  for (int r = 0; r < pg.getSize(); ++r) {
    all.emplace_back(static_cast<const char*>(out[0][r].data_ptr()), size[0][r].item<int64_t>());
  }
  return all;
}

// Trains `m` from step `from` to `to` on `pg`, 12 rows a step split over its
// ranks (the same global batch at any world size), Adam stepped by GradSync
// (sharded by `how`; Shard::None: by the trainer after backward), first
// loading `shards` if given.
void train_span(Gated& m, torch::optim::Adam& adam, const ddpx::comm::ProcessGroupPtr& pg, int from,
                int to, const std::vector<std::string>* shards = nullptr,
                std::string* shard_out = nullptr, Shard how = Shard::Gradients) {
  GradSync sync(m->named_parameters(), pg,
                GradSyncOptions().shard(how).bucket_cap_mb(0.001).first_bucket_mb(0.0005));
  if (how != Shard::None) sync.set_optimizer(adam);
  if (shards) {
    sync.load_optimizer_shards(adam, static_cast<int>(shards->size()),
                               [shards](int k) { return (*shards)[k]; });
  }
  const int w = pg->getSize(), r = pg->getRank();
  for (int step = from; step < to; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
    const auto rows = at::randn({12, 6}, gen, at::kDouble);
    if (how == Shard::None) adam.zero_grad();
    m->forward(rows.narrow(0, r * 12 / w, 12 / w), step).backward();
    if (how == Shard::None) adam.step();
  }
  if (shard_out) *shard_out = sync.optimizer_shard(adam);
}

std::vector<at::Tensor> values(Gated& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m->parameters()) out.push_back(p.detach().clone());
  return out;
}

// A run saved midway (each rank's optimizer shard) and resumed on all the
// ranks, and on one fewer (the state re-split by bytes), ends where the
// straight run does: bit for bit at the same world size, within rounding at
// another (its averages sum the 12 rows in other groups).
TEST(GradSyncShardCheckpoint, ResumesAtTheSameAndAnotherWorldSize) {
  auto& pg = world();
  const int w = pg->getSize(), rank = pg->getRank();
  auto fresh = [] {
    torch::manual_seed(7);
    return Gated();
  };
  Gated straight = fresh();
  torch::optim::Adam straight_adam(straight->parameters(), torch::optim::AdamOptions(0.01));
  train_span(straight, straight_adam, pg, 0, 24);
  const auto want = values(straight);

  Gated first = fresh();
  torch::optim::Adam first_adam(first->parameters(), torch::optim::AdamOptions(0.01));
  std::string mine;
  train_span(first, first_adam, pg, 0, 12, nullptr, &mine);
  const auto shards = all_bytes(*pg, mine);
  const auto midway = values(first);
  for (int n : {w, w - 1}) {
    if (rank >= n) continue;
    const auto group = n == w ? pg : first_ranks(n);  // (collective over its members)
    Gated again = fresh();
    {
      at::NoGradGuard no_grad;
      const auto ps = again->parameters();
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(midway[i]);
    }
    torch::optim::Adam adam(again->parameters(), torch::optim::AdamOptions(0.01));
    train_span(again, adam, group, 12, 24, &shards);
    const auto got = values(again);
    for (size_t i = 0; i < got.size(); ++i) {
      if (n == w) {
        EXPECT_TRUE(at::equal(got[i], want[i])) << "parameter " << i << ", resumed on " << n;
      } else {
        EXPECT_TRUE(at::allclose(got[i], want[i], 1e-9, 1e-12))
            << "parameter " << i << ", resumed on " << n << ": differs by up to "
            << (got[i] - want[i]).abs().max().item<double>();
      }
    }
  }
  pg->barrier()->wait();
}

// Between sharded and unsharded runs: a whole state (torch::save of an
// unsharded run's optimizer) loads into a sharded run, cut to each rank's
// part at its first step, and a sharded checkpoint's shards load into an
// unsharded run as the whole state; both end where the straight run does.
TEST(GradSyncShardCheckpoint, MovesBetweenShardedAndUnshardedRuns) {
  auto& pg = world();
  auto fresh = [] {
    torch::manual_seed(7);
    return Gated();
  };
  Gated straight = fresh();
  torch::optim::Adam straight_adam(straight->parameters(), torch::optim::AdamOptions(0.01));
  train_span(straight, straight_adam, pg, 0, 24, nullptr, nullptr, Shard::None);
  const auto want = values(straight);
  for (Shard first_how : {Shard::None, Shard::Optimizer}) {
    Gated first = fresh();
    torch::optim::Adam first_adam(first->parameters(), torch::optim::AdamOptions(0.01));
    std::string mine;
    train_span(first, first_adam, pg, 0, 12, nullptr, &mine, first_how);
    std::stringstream saved;
    torch::save(first_adam, saved);
    const auto shards = all_bytes(*pg, mine);
    Gated again = fresh();
    {
      at::NoGradGuard no_grad;
      const auto ps = again->parameters();
      const auto midway = values(first);
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(midway[i]);
    }
    torch::optim::Adam adam(again->parameters(), torch::optim::AdamOptions(0.01));
    if (first_how == Shard::None) {
      torch::load(adam, saved);  // the whole state, into a sharded run
      train_span(again, adam, pg, 12, 24, nullptr, nullptr, Shard::Gradients);
    } else {
      train_span(again, adam, pg, 12, 24, &shards, nullptr, Shard::None);
    }
    const auto got = values(again);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(at::equal(got[i], want[i]))
          << "parameter " << i
          << (first_how == Shard::None ? ": whole into sharded" : ": shards into unsharded");
    }
  }
}

TEST(GradSyncShardCheckpoint, AMissingOrRepeatedShardIsAnError) {
  auto& pg = world();
  torch::manual_seed(7);
  Gated m;
  torch::optim::Adam adam(m->parameters(), torch::optim::AdamOptions(0.01));
  std::string mine;
  train_span(m, adam, pg, 0, 2, nullptr, &mine);
  const auto shards = all_bytes(*pg, mine);
  GradSync sync(m->named_parameters(), pg, GradSyncOptions().shard(Shard::Optimizer));
  sync.set_optimizer(adam);
  auto e = error_of([&] { sync.load_optimizer_shards(adam, 1, [&](int) { return shards[0]; }); });
  EXPECT_NE(e.find("give every rank's shard of it"), std::string::npos) << e;
  const int w = pg->getSize();
  e = error_of([&] { sync.load_optimizer_shards(adam, w, [&](int) { return shards[0]; }); });
  EXPECT_NE(e.find("give every rank's shard once"), std::string::npos) << e;
  torch::optim::SGD sgd(m->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  e = error_of([&] { sync.load_optimizer_shards(sgd, w, [&](int k) { return shards[k]; }); });
  EXPECT_NE(e.find("holds the state of Adam, the optimizer is SGD"), std::string::npos) << e;
}

// ---- misuse ------------------------------------------------------------------

TEST(GradSyncShardErrors, UnsupportedCombinationsNameBothOptions) {
  auto& pg = world();
  torch::manual_seed(3);
  Gated m;
  auto make = [&](GradSyncOptions o) {
    GradSync s(m->named_parameters(), pg, o.shard(Shard::Gradients));
  };
  for (const char* codec : {"topk:0.1", "powersgd:2"}) {
    auto e = error_of([&] { make(GradSyncOptions().codec(codec)); });
    EXPECT_NE(e.find("shard(Shard::Gradients) with codec('" + std::string(codec) +
                     "'): the codec has no sharded form"),
              std::string::npos)
        << e;
  }
  std::string e;
  e = error_of([&] { make(GradSyncOptions().overlap(Overlap::Optimizer).staleness(1)); });
  EXPECT_NE(e.find("with staleness(1)"), std::string::npos) << e;
  e = error_of([&] { make(GradSyncOptions().mixed_precision(at::kBFloat16, at::kFloat)); });
  EXPECT_NE(e.find("with mixed_precision"), std::string::npos) << e;
  e = error_of([&] { make(GradSyncOptions().sparse_params({"trunk.weight"})); });
  EXPECT_NE(e.find("sparse_params names 'trunk.weight'"), std::string::npos) << e;
  // The optimizer: required (also under Overlap::None), holding every parameter.
  GradSync sync(m->named_parameters(), pg, GradSyncOptions().shard(Shard::Optimizer));
  auto x = shard(global_batch(6, 5), pg->getRank());
  e = error_of([&] { m->forward(x, 0).backward(); });
  EXPECT_NE(e.find("shard"), std::string::npos) << e;
  EXPECT_NE(e.find("set_optimizer"), std::string::npos) << e;
  torch::optim::SGD part(m->trunk->parameters(), torch::optim::SGDOptions(0.1));
  e = error_of([&] { sync.set_optimizer(part); });
  EXPECT_NE(e.find("with GradSyncOptions::shard it must hold every parameter"), std::string::npos)
      << e;
}

}  // namespace
