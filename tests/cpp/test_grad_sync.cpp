// GradSync under mpirun (2 and 3 ranks). The reference for every model is
// one process computing the gradient of the whole batch (all ranks' shards):
// N ranks x batch B must give the gradients of 1 process x batch N*B.
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>

#include "grad_sync_test_models.h"

namespace {

using ddpx::GradSync;
using ddpx::GradSyncOptions;
using ddpx::Unused;
using namespace ddpx::test::grad_sync;

struct MLPImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  MLPImpl() {
    a = register_module("a", torch::nn::Linear(8, 16));
    b = register_module("b", torch::nn::Linear(16, 16));
    c = register_module("c", torch::nn::Linear(16, 3));
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) { return c(torch::tanh(b(torch::relu(a(x))))); }
};
TORCH_MODULE(MLP);

TEST(GradSync, MLPMatchesOneProcess) {
  expect_matches_reference<MLP>(
      [] { return MLP(); }, [](MLP& m, const at::Tensor& x, int) { return m(x).pow(2).mean(); }, 8);
}

TEST(GradSync, MLPGradAsBucketViewZeroedInPlace) {
  expect_matches_reference<MLP>(
      [] { return MLP(); }, [](MLP& m, const at::Tensor& x, int) { return m(x).pow(2).mean(); }, 8,
      GradSyncOptions().bucket_cap_mb(0.002), 4, /*zero_in_place=*/true);
}

TEST(GradSync, MLPWithoutGradAsBucketView) {
  for (bool in_place : {false, true}) {
    expect_matches_reference<MLP>(
        [] { return MLP(); }, [](MLP& m, const at::Tensor& x, int) { return m(x).pow(2).mean(); },
        8, GradSyncOptions().gradient_as_bucket_view(false), 3, in_place);
  }
}

TEST(GradSync, MLPWithTinyBucketsAndTwoChannels) {
  GradSyncOptions o;
  o.bucket_cap_mb(0.0005).first_bucket_mb(0.0002);
  o.channels.push_back(ddpx::comm::make("ddpx_mpi"));
  expect_matches_reference<MLP>([] { return MLP(); },
                                [](MLP& m, const at::Tensor& x, int) { return m(x).pow(2).mean(); },
                                8, o);
}

struct CNNImpl : torch::nn::Module {
  torch::nn::Conv2d c1{nullptr}, c2{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc{nullptr};
  CNNImpl() {
    c1 = register_module("c1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)));
    bn = register_module("bn", torch::nn::BatchNorm2d(4));
    c2 = register_module("c2", torch::nn::Conv2d(4, 4, 3));
    fc = register_module("fc", torch::nn::Linear(4 * 2 * 2, 5));
    to(at::kDouble);
    eval();  // running statistics are buffers: broadcast, not reduced
  }
  at::Tensor forward(const at::Tensor& x) {
    auto y = torch::relu(bn(c1(x.view({-1, 1, 4, 4}))));
    return fc(torch::relu(c2(y)).flatten(1));
  }
};
TORCH_MODULE(CNN);

TEST(GradSync, CNNMatchesOneProcess) {
  expect_matches_reference<CNN>([] { return CNN(); },
                                [](CNN& m, const at::Tensor& x, int) { return m(x).pow(2).mean(); },
                                16);
}

// Tiny buckets, so many are on the wire at once (calls_in_flight 3) or one
// at a time (1); both equal the one process.
TEST(GradSync, CNNWithBucketsInFlightOrOneAtATime) {
  for (int in_flight : {3, 1}) {
    SCOPED_TRACE(in_flight);
    expect_matches_reference<CNN>(
        [] { return CNN(); }, [](CNN& m, const at::Tensor& x, int) { return m(x).pow(2).mean(); },
        16,
        GradSyncOptions().bucket_cap_mb(0.0002).first_bucket_mb(0.0001).calls_in_flight(in_flight));
  }
  CNN m;
  EXPECT_THROW(
      {
        try {
          GradSync sync(m->named_parameters(), world(), GradSyncOptions().calls_in_flight(0));
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("calls_in_flight"), std::string::npos) << e.what();
          throw;
        }
      },
      c10::Error);
}

// The hooks move a small contiguous gradient into its slot with memcpy and
// anything else with copy_: channels-last convolution weights (gradients laid
// out like them, not like the slot), a Linear of more than 32768 elements,
// and the small contiguous rest, in one model, set_to_none and in place.
struct MixedLayoutImpl : torch::nn::Module {
  CNN cnn;
  torch::nn::Linear wide{nullptr};
  MixedLayoutImpl() {
    cnn = register_module("cnn", CNN());
    wide = register_module("wide", torch::nn::Linear(5, 7000));
    wide->to(at::kDouble);
    torch::NoGradGuard no_grad;
    for (auto& p : cnn->parameters()) {
      if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
    }
  }
  at::Tensor forward(const at::Tensor& x) { return wide(cnn(x)).pow(2).mean(); }
};
TORCH_MODULE(MixedLayout);

TEST(GradSync, ChannelsLastAndLargeGradientsMatchOneProcess) {
  {
    MixedLayout m;
    ASSERT_FALSE(m->cnn->c2->weight.is_contiguous());
    ASSERT_GT(m->wide->weight.numel(), 32768);
  }
  for (bool in_place : {false, true}) {
    expect_matches_reference<MixedLayout>(
        [] { return MixedLayout(); }, [](MixedLayout& m, const at::Tensor& x, int) { return m(x); },
        16, GradSyncOptions().bucket_cap_mb(0.05), 3, in_place);
  }
}

// Tied weights (one tensor registered twice) and a frozen layer.
struct TiedImpl : torch::nn::Module {
  torch::nn::Linear enc{nullptr}, frozen{nullptr};
  at::Tensor shared;
  TiedImpl() {
    enc = register_module("enc", torch::nn::Linear(5, 5));
    frozen = register_module("frozen", torch::nn::Linear(5, 5));
    to(at::kDouble);
    shared = register_parameter("shared", enc->weight, /*requires_grad=*/true);
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::tanh(enc(frozen(x)));
    return torch::matmul(h, shared.t()).pow(2).mean();
  }
};
TORCH_MODULE(Tied);

TEST(GradSync, TiedAndFrozenParameters) {
  expect_matches_reference<Tied>([] { return Tied(); },
                                 [](Tied& m, const at::Tensor& x, int) { return m(x); }, 5);
}

// A frozen layer between trainable ones, on ranks seeded differently: the
// frozen weights must be rank 0's everywhere (verified and broadcast like the
// trainable ones, as under DDP), else every rank computes another function
// and the averaged gradients match no single model.
struct FrozenMidImpl : torch::nn::Module {
  torch::nn::Linear in{nullptr}, frozen{nullptr}, out{nullptr};
  FrozenMidImpl() {
    in = register_module("in", torch::nn::Linear(6, 7));
    frozen = register_module("frozen", torch::nn::Linear(7, 7));
    out = register_module("out", torch::nn::Linear(7, 3));
    to(at::kDouble);
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  at::Tensor forward(const at::Tensor& x) {
    return out(torch::tanh(frozen(torch::tanh(in(x))))).pow(2).mean();
  }
};
TORCH_MODULE(FrozenMid);

TEST(GradSync, FrozenParametersAreBroadcastFromRankZero) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  ddpx::comm::MakeOptions o;
  o.name = "frozen_gloo";
  const auto gloo = ddpx::comm::make("gloo", o);
  for (const auto& [backend, group] : {std::pair{"ddpx_mpi", pg}, std::pair{"gloo", gloo}}) {
    for (const Unused unused : {Unused::Predict, Unused::Exact}) {
      const std::string where =
          std::string(backend) + (unused == Unused::Exact ? " Exact" : " Predict");
      torch::manual_seed(21);
      FrozenMid ref;
      torch::manual_seed(21 + 1000 * r);  // rank 0's model is the reference's
      FrozenMid m;
      GradSync sync(m->named_parameters(), group, GradSyncOptions().unused(unused));
      for (const auto& item : ref->named_parameters()) {
        EXPECT_TRUE(at::equal(m->named_parameters()[item.key()], item.value()))
            << item.key() << " " << where;
      }
      torch::optim::SGD ref_opt(ref->parameters(), 0.1), opt(m->parameters(), 0.1);
      for (int step = 0; step < 3; ++step) {
        const auto g = global_batch(6, 60 + step);
        ref_opt.zero_grad();
        backward_global(ref, g, n);
        opt.zero_grad();
        auto loss = m(shard(g, r));
        if (unused == Unused::Exact) sync.prepare_for_backward({loss});
        loss.backward();
        expect_grads_match(m, ref, 1e-5, 1e-12, where + " step " + std::to_string(step));
        ref_opt.step();
        opt.step();
      }
    }
  }
}

// A parameter frozen on one rank but trainable on another would train on
// some ranks only: named at construction.
TEST(GradSync, FrozenOnOneRankOnlyNamesTheParameter) {
  auto& pg = world();
  if (pg->getSize() < 2) GTEST_SKIP() << "needs 2 ranks";
  FrozenMid m;
  if (pg->getRank() == 1) m->frozen->bias.set_requires_grad(true);
  try {
    GradSync sync(m->named_parameters(), pg);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'frozen.bias'"), std::string::npos) << what;
    EXPECT_NE(what.find("frozen on rank 0 but trainable on rank 1"), std::string::npos) << what;
  }
}

TEST(GradSync, BuffersAndParametersBroadcastFromRankZero) {
  auto& pg = world();
  torch::manual_seed(77 + pg->getRank());  // different init on every rank
  CNN m;
  m->bn->running_mean.fill_(pg->getRank() + 1.0);
  GradSync sync(m->named_parameters(), pg, {}, m->named_buffers());
  EXPECT_TRUE(at::equal(m->bn->running_mean, at::full({4}, 1.0, at::kDouble)));
  torch::manual_seed(77);
  CNN rank0;
  EXPECT_TRUE(at::equal(m->c1->weight, rank0->c1->weight));
}

// In training mode BatchNorm updates its running statistics from each rank's
// own batch. After every synced backward they are rank 0's on every rank (as
// under DDP's broadcast_buffers): those of rank 0's model run alone on rank
// 0's batches. With the option off each rank keeps its own.
TEST(GradSync, BuffersFollowRankZeroAfterEveryStep) {
  auto& pg = world();
  const int r = pg->getRank();
  for (bool on : {true, false}) {
    torch::manual_seed(3);
    CNN m;
    m->train();
    GradSync sync(m->named_parameters(), pg, GradSyncOptions().broadcast_buffers(on),
                  m->named_buffers());
    torch::manual_seed(3);
    CNN rank0_alone;
    rank0_alone->train();
    for (int step = 0; step < 3; ++step) {
      const auto g = global_batch(16, 40 + step);
      m->zero_grad();
      m(shard(g, r)).pow(2).mean().backward();
      rank0_alone(shard(g, 0));
      const bool same =
          at::allclose(m->bn->running_mean, rank0_alone->bn->running_mean, 1e-12, 0) &&
          at::allclose(m->bn->running_var, rank0_alone->bn->running_var, 1e-12, 0) &&
          at::equal(m->bn->num_batches_tracked, rank0_alone->bn->num_batches_tracked);
      if (on || r == 0) {
        EXPECT_TRUE(same) << "broadcast_buffers(" << on << ") step " << step;
      } else {
        EXPECT_FALSE(same) << "broadcast_buffers(false) step " << step << ": rank " << r
                           << " should keep its own statistics";
      }
    }
  }
}

// Gathers a flat copy of all parameters from every rank; all must be equal.
void expect_bitwise_equal_across_ranks(torch::nn::Module& m) {
  auto& pg = world();
  std::vector<at::Tensor> flat_parts;
  for (const auto& p : m.parameters()) flat_parts.push_back(p.detach().reshape(-1));
  auto flat = at::cat(flat_parts);
  std::vector<std::vector<at::Tensor>> out(1);
  for (int i = 0; i < pg->getSize(); ++i) out[0].push_back(at::empty_like(flat));
  std::vector<at::Tensor> in{flat};
  pg->allgather(out, in)->wait();
  for (int i = 1; i < pg->getSize(); ++i) EXPECT_TRUE(at::equal(out[0][0], out[0][i])) << i;
}

TEST(GradSync, HundredSgdStepsStayBitwiseEqual) {
  auto& pg = world();
  torch::manual_seed(5);
  MLP m;
  GradSync sync(m->named_parameters(), pg, GradSyncOptions().bucket_cap_mb(0.002));
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < 100; ++step) {
    auto x = at::randn({kB, 8}, at::kDouble) * (pg->getRank() + 1);  // differs per rank
    opt.zero_grad();
    m(x).pow(2).mean().backward();
    opt.step();
  }
  expect_bitwise_equal_across_ranks(*m);
}

void expect_flip_replans_once(bool zero_in_place) {
  auto& pg = world();
  const int n = pg->getSize();
  torch::manual_seed(9);
  Flip ref;
  torch::manual_seed(9);  // the reference starts from the same weights
  Flip m;
  GradSync sync(m->named_parameters(), pg,
                GradSyncOptions().bucket_cap_mb(0.002).first_bucket_mb(0.002).timed_plans(false));
  std::vector<int64_t> replans;
  for (int step = 0; step < 10; ++step) {
    ref->step = m->step = step;
    auto g = global_batch(16, 300 + step);
    ref->zero_grad();
    backward_global(ref, g, n);
    m->zero_grad(/*set_to_none=*/!zero_in_place);
    m(shard(g, pg->getRank())).backward();
    auto rp = ref->named_parameters();
    for (const auto& item : m->named_parameters()) {
      EXPECT_TRUE(at::allclose(item.value().grad(), rp[item.key()].grad(), 1e-5, 1e-8))
          << item.key() << " step " << step;
    }
    replans.push_back(sync.replans());
  }
  // Registration order t0..t5 = forward order: backward runs t5..t0, the
  // initial (reverse) plan fits; after the flip it does not: one re-plan.
  EXPECT_EQ(replans[FlipImpl::kFlip - 1], 0);
  EXPECT_EQ(replans.back(), 1) << "re-planned " << replans.back() << " times";
}

TEST(GradSync, OrderChangeReplansOnceAndStaysExact) {
  // In place: .grad views the old buckets when the re-plan reallocates them.
  for (bool in_place : {false, true}) {
    SCOPED_TRACE(in_place ? "zero_grad in place" : "zero_grad set_to_none");
    expect_flip_replans_once(in_place);
  }
}

// views: one synced step first, then zero_grad in place, so that the no_sync
// micro-batches accumulate straight into the buckets.
void expect_no_sync_equals_large_batch(bool views) {
  auto& pg = world();
  const int n = pg->getSize();
  torch::manual_seed(3);
  MLP ref;
  torch::manual_seed(3);
  MLP m;
  GradSync sync(m->named_parameters(), pg);
  if (views) {
    m(at::randn({kB, 8}, at::kDouble)).pow(2).mean().backward();
    m->zero_grad(/*set_to_none=*/false);
  }
  // Three micro-batches per rank: two under no_sync, the third synced.
  std::vector<at::Tensor> gs;
  for (int k = 0; k < 3; ++k) gs.push_back(global_batch(8, 500 + k));
  at::Tensor total;
  for (int k = 0; k < 3; ++k) {
    for (int r = 0; r < n; ++r) {
      auto l = ref(shard(gs[k], r)).pow(2).mean() / n;
      total = total.defined() ? total + l : l;
    }
  }
  total.backward();
  {
    auto guard = sync.no_sync();
    m(shard(gs[0], pg->getRank())).pow(2).mean().backward();
    m(shard(gs[1], pg->getRank())).pow(2).mean().backward();
  }
  m(shard(gs[2], pg->getRank())).pow(2).mean().backward();
  auto rp = ref->named_parameters();
  for (const auto& item : m->named_parameters()) {
    EXPECT_TRUE(at::allclose(item.value().grad(), rp[item.key()].grad(), 1e-5, 1e-8)) << item.key();
  }
}

TEST(GradSync, NoSyncAccumulationEqualsOneLargeBatch) {
  expect_no_sync_equals_large_batch(/*views=*/false);
  expect_no_sync_equals_large_batch(/*views=*/true);
}

TEST(GradSync, MismatchedModelsNameTheParameter) {
  auto& pg = world();
  if (pg->getSize() < 2) GTEST_SKIP() << "needs 2 ranks";
  torch::nn::Sequential m(torch::nn::Linear(4, pg->getRank() == 1 ? 5 : 4),
                          torch::nn::Linear(4, 4));
  try {
    GradSync sync(m->named_parameters(), pg);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'0.weight'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
  }
  torch::nn::Sequential extra(torch::nn::Linear(4, 4));
  if (pg->getRank() == 1) extra->push_back(torch::nn::Linear(4, 4));
  try {
    GradSync sync(extra->named_parameters(), pg);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameters but rank 1 has 4"), std::string::npos)
        << e.what();
  }
  // Buffers are broadcast every step: one that differs is named up front.
  torch::nn::Linear lin(4, 4);
  lin->register_buffer("stat", torch::zeros({pg->getRank() == 1 ? 3 : 2}));
  try {
    GradSync sync(lin->named_parameters(), pg, {}, lin->named_buffers());
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("buffer 'stat'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
  }
}

// A group with no backend for CPU tensors (here Gloo for CUDA only; "nccl"
// alone is another) cannot carry the step agreements, and a channel with none
// for the parameters' device cannot carry their buckets: both are named at
// construction, before any collective, on every rank.
TEST(GradSync, AGroupWithoutABackendForTheTensorsIsNamed) {
  ddpx::comm::MakeOptions o;
  o.name = "cuda_only";
  auto cuda_only = ddpx::comm::make("cuda:gloo", o);
  MLP m;
  try {
    GradSync sync(m->named_parameters(), cuda_only);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("process group 'cuda_only' has no backend for CPU tensors"),
        std::string::npos)
        << e.what();
  }
  GradSyncOptions with_channel;
  with_channel.channels.push_back(cuda_only);
  try {
    GradSync sync(m->named_parameters(), world(), with_channel);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("channel 'cuda_only' has no backend for CPU tensors"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace

// After GradSync is gone a later backward must be a plain local one (no call
// into freed memory, no communication).
TEST(GradSync, BackwardAfterDestructionIsLocal) {
  auto& pg = world();
  torch::manual_seed(5);
  MLP model;
  const auto x = global_batch(8, 77).narrow(0, pg->getRank() * kB, kB);
  {
    GradSync sync(model->named_parameters(), pg);
    model->forward(x).sum().backward();
  }
  model->zero_grad();
  model->forward(x).sum().backward();  // ranks see different shards: local grads differ
  MLP ref;
  torch::NoGradGuard no_grad;
  for (const auto& item : model->named_parameters()) {
    ref->named_parameters()[item.key()].copy_(item.value());
  }
  torch::GradMode::set_enabled(true);
  ref->forward(x).sum().backward();
  for (const auto& item : ref->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value().grad(), model->named_parameters()[item.key()].grad()))
        << item.key();
  }
}

// A trainer that builds GradSync anew over the same parameters (per phase,
// per run in one process) must not pile up hooks on their accumulators: the
// destructor removes its own, and each backward calls one.
TEST(GradSync, ConstructionsDoNotPileUpHooks) {
  auto& pg = world();
  torch::manual_seed(5);
  MLP model;
  const auto x = global_batch(8, 78).narrow(0, pg->getRank() * kB, kB);
  std::vector<size_t> before;
  for (const auto& p : model->parameters()) {
    before.push_back(torch::autograd::impl::grad_accumulator(p)->post_hooks().size());
  }
  for (int i = 0; i < 20; ++i) {
    GradSync sync(model->named_parameters(), pg);
    model->zero_grad();
    model->forward(x).sum().backward();
    size_t k = 0;
    for (const auto& p : model->parameters()) {
      EXPECT_EQ(torch::autograd::impl::grad_accumulator(p)->post_hooks().size(), before[k++] + 1);
    }
  }
  size_t k = 0;
  for (const auto& p : model->parameters()) {
    EXPECT_EQ(torch::autograd::impl::grad_accumulator(p)->post_hooks().size(), before[k++]);
  }
}
