// GradSync under mpirun (2 and 3 ranks). The reference for every model is
// one process computing the gradient of the whole batch (all ranks' shards):
// N ranks x batch B must give the gradients of 1 process x batch N*B.
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <torch/torch.h>

#include <functional>

#include "grad_sync_test_models.h"

namespace {

using ddpx::GradSync;
using ddpx::GradSyncOptions;
using ddpx::Unused;
using namespace ddpx::test::grad_sync;

// loss_of(model, x, rank) -> scalar loss for a shard. The reference averages
// the per-shard losses (equal shard sizes: the mean over the whole batch).
template <typename M>
using LossFn = std::function<at::Tensor(M&, const at::Tensor&, int)>;

// zero_in_place: zero_grad(set_to_none=false) between steps, so that .grad
// stays the bucket view and backward accumulates into the bucket.
template <typename M>
void expect_matches_reference(std::function<M()> make, LossFn<M> loss_of, int64_t features,
                              GradSyncOptions opts = {}, int steps = 3, bool zero_in_place = false) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  torch::manual_seed(1234);
  M ref = make();
  torch::manual_seed(1234 + 0);  // same init on every rank, GradSync broadcasts anyway
  M model = make();
  GradSync sync((*model).named_parameters(), pg, opts, (*model).named_buffers());
  for (int step = 0; step < steps; ++step) {
    auto g = global_batch(features, 100 + step);
    (*ref).zero_grad(/*set_to_none=*/!zero_in_place);
    at::Tensor total;
    for (int k = 0; k < n; ++k) {
      auto l = loss_of(ref, shard(g, k), k) / n;
      total = total.defined() ? total + l : l;
    }
    total.backward();
    (*model).zero_grad(/*set_to_none=*/!zero_in_place);
    auto loss = loss_of(model, shard(g, r), r);
    if (opts.unused_ == Unused::Exact) sync.prepare_for_backward({loss});
    loss.backward();
    auto rp = (*ref).named_parameters();
    for (const auto& item : (*model).named_parameters()) {
      const auto& want = rp[item.key()].grad();
      const auto& got = item.value().grad();
      ASSERT_EQ(want.defined(), got.defined()) << item.key() << " step " << step;
      if (want.defined()) {
        EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-8)) << item.key() << " step " << step;
      }
    }
  }
}

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
  expect_matches_reference<MLP>([] { return MLP(); },
                                [](MLP& m, const at::Tensor& x, int) { return m(x).pow(2).mean(); },
                                8);
}

TEST(GradSync, MLPGradAsBucketViewZeroedInPlace) {
  expect_matches_reference<MLP>([] { return MLP(); },
                                [](MLP& m, const at::Tensor& x, int) { return m(x).pow(2).mean(); },
                                8, GradSyncOptions().bucket_cap_mb(0.002), 4, /*zero_in_place=*/true);
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

// A head that is never used, and a branch taken by some ranks only.
struct BranchyImpl : torch::nn::Module {
  torch::nn::Linear trunk{nullptr}, left{nullptr}, right{nullptr}, never{nullptr};
  BranchyImpl() {
    trunk = register_module("trunk", torch::nn::Linear(6, 6));
    left = register_module("left", torch::nn::Linear(6, 2));
    right = register_module("right", torch::nn::Linear(6, 2));
    never = register_module("never", torch::nn::Linear(6, 2));
    to(at::kDouble);
  }
  // Rank-dependent data decides the branch: even ranks go left, odd right.
  at::Tensor forward(const at::Tensor& x, int rank) {
    auto h = torch::relu(trunk(x));
    return (rank % 2 == 0 ? left(h) : right(h)).pow(2).mean();
  }
};
TORCH_MODULE(Branchy);

// Six steps: from step 3 on, left and right (each unused on some rank) are in
// a late bucket on every rank, and never (unused everywhere) is not sent.
TEST(GradSync, UnusedAndRankDependentBranchesPredict) {
  expect_matches_reference<Branchy>(
      [] { return Branchy(); },
      [](Branchy& m, const at::Tensor& x, int rank) { return m(x, rank); }, 6,
      GradSyncOptions().unused(Unused::Predict), 6);
}

// Lateness is "unused on some rank", agreed, so every rank plans left and
// right (each unused on half the ranks) and never into the late bucket, with
// no per-rank copy of a slot; never's bytes stay off the wire.
TEST(GradSync, RankDependentBranchesShareOneLatePlan) {
  auto& pg = world();
  if (pg->getSize() < 2) GTEST_SKIP();
  torch::manual_seed(25);
  Branchy m;
  GradSync sync(m->named_parameters(), pg);
  auto x = at::randn({kB, 6}, at::kDouble);
  for (int step = 0; step < 4; ++step) {
    m->zero_grad(/*set_to_none=*/false);
    m(x, pg->getRank()).backward();
  }
  EXPECT_EQ(sync.replans(), 1);
  auto last = sync.bucket_plan().back();
  std::sort(last.begin(), last.end());
  EXPECT_EQ(last, (std::vector<std::string>{"left.bias", "left.weight", "never.bias",
                                            "never.weight", "right.bias", "right.weight"}));
  int64_t all = 0;
  for (const auto& p : m->parameters()) all += p.numel() * 8;
  EXPECT_EQ(sync.last_step().bytes_reduced, all - (6 * 2 + 2) * 8);
}

TEST(GradSync, UnusedAndRankDependentBranchesExact) {
  expect_matches_reference<Branchy>(
      [] { return Branchy(); },
      [](Branchy& m, const at::Tensor& x, int rank) { return m(x, rank); }, 6,
      GradSyncOptions().unused(Unused::Exact).bucket_cap_mb(0.0001).first_bucket_mb(0.0001), 3);
}

TEST(GradSync, UnusedBranchesWithGradAsBucketView) {
  for (Unused u : {Unused::Predict, Unused::Exact}) {
    expect_matches_reference<Branchy>(
        [] { return Branchy(); },
        [](Branchy& m, const at::Tensor& x, int rank) { return m(x, rank); }, 6,
        GradSyncOptions().unused(u).bucket_cap_mb(0.0001).first_bucket_mb(0.0001), 4,
        /*zero_in_place=*/true);
  }
}

// Steps m (under sync) through `branches` of its forward on x; with
// `zero_in_place`, zero_grad(set_to_none=false) before each step.
void step_branches(Branchy& m, GradSync& sync, Unused u, const at::Tensor& x,
                   std::initializer_list<int> branches, bool zero_in_place = false) {
  for (int branch : branches) {
    if (zero_in_place) m->zero_grad(/*set_to_none=*/false);
    auto loss = m(x, branch);
    if (u == Unused::Exact) sync.prepare_for_backward({loss});
    loss.backward();
  }
}

// .grad of "left" is a bucket view after a step where every rank used it;
// the next step no rank uses it: its slot contributes zeros, yet .grad (not
// zeroed by the user in between) must keep its value, as under DDP.
TEST(GradSync, GloballyUnusedViewGradStaysUntouched) {
  auto& pg = world();
  for (Unused u : {Unused::Predict, Unused::Exact}) {
    torch::manual_seed(11);
    Branchy m;
    GradSync sync(m->named_parameters(), pg, GradSyncOptions().unused(u));  // one bucket
    auto x = at::randn({kB, 6}, at::kDouble) * (pg->getRank() + 1);
    step_branches(m, sync, u, x, {0});
    ASSERT_TRUE(m->left->weight.grad().is_alias_of(m->trunk->weight.grad())) << "not in a bucket";
    step_branches(m, sync, u, x, {1});
    // Reference: the same two steps without GradSync's views (accumulating).
    auto left = m->left->weight.grad();
    torch::manual_seed(11);
    Branchy ref;
    GradSync ref_sync(ref->named_parameters(), pg,
                      GradSyncOptions().unused(u).gradient_as_bucket_view(false));
    step_branches(ref, ref_sync, u, x, {0, 1});
    EXPECT_TRUE(at::equal(left, ref->left->weight.grad()));
    EXPECT_TRUE(at::equal(m->right->weight.grad(), ref->right->weight.grad()));
    EXPECT_GT(left.abs().sum().item<double>(), 0.0) << "left.grad was zeroed";
    EXPECT_FALSE(m->never->weight.grad().defined());
  }
}

// As above with zero_grad in place before each step: the idle parameter's
// .grad is its slot and holds zeros, so it stays in the bucket (not copied
// out) and stays zero.
TEST(GradSync, GloballyUnusedZeroedViewGradStaysInItsBucket) {
  auto& pg = world();
  for (Unused u : {Unused::Predict, Unused::Exact}) {
    torch::manual_seed(11);
    Branchy m;
    GradSync sync(m->named_parameters(), pg, GradSyncOptions().unused(u));  // one bucket
    auto x = at::randn({kB, 6}, at::kDouble) * (pg->getRank() + 1);
    step_branches(m, sync, u, x, {0, 1}, /*zero_in_place=*/true);
    const auto& left = m->left->weight.grad();
    EXPECT_TRUE(left.is_alias_of(m->trunk->weight.grad())) << "left.grad left its bucket";
    EXPECT_EQ(left.abs().sum().item<double>(), 0.0);
    EXPECT_GT(m->right->weight.grad().abs().sum().item<double>(), 0.0);
  }
}

// Once the late set has settled (both experts late after two steps), the
// idle expert's bytes stay off the wire -- DDP would send its zeros -- the
// plan does not churn with the alternation, and gradients stay exact.
TEST(GradSync, AlternatingExpertsSkipTheIdleOneAndStayExact) {
  auto& pg = world();
  const int n = pg->getSize();
  for (const auto& [u, in_place] : kExpertModes) {
    SCOPED_TRACE(mode_name(u, in_place));
    auto [ref, m] = twin_experts(21);
    GradSync sync(m->named_parameters(), pg, GradSyncOptions().unused(u));
    int64_t all_bytes = 0;
    for (const auto& p : m->parameters()) all_bytes += p.numel() * 8;
    const int64_t expert_bytes = (6 * 6 + 6) * 8;
    for (int step = 0; step < 9; ++step) {
      ref->step = m->step = step;
      auto g = global_batch(6, 700 + step);
      ref->zero_grad(/*set_to_none=*/!in_place);
      backward_global(ref, g, n);
      m->zero_grad(/*set_to_none=*/!in_place);
      auto loss = m(shard(g, pg->getRank()));
      if (u == Unused::Exact) sync.prepare_for_backward({loss});
      loss.backward();
      expect_grads_match(m, ref, 1e-5, 1e-8, "step " + std::to_string(step));
      if (step >= 3) {
        EXPECT_EQ(sync.last_step().bytes_reduced, all_bytes - expert_bytes) << "step " << step;
      }
    }
    EXPECT_EQ(sync.replans(), 1);
    // The experts share a late bucket; no reliable tensor is with them. Under
    // Predict it is the last bucket (it waits for the step-end agreement);
    // under Exact (agreed before backward) it sits where the experts'
    // gradients arrive, before the trunk's, and launches as soon as ready.
    const auto plan = sync.bucket_plan();
    auto has = [](const std::vector<std::string>& b, const std::string& name) {
      return std::find(b.begin(), b.end(), name) != b.end();
    };
    size_t experts = plan.size(), trunk = plan.size();
    for (size_t i = 0; i < plan.size(); ++i) {
      if (has(plan[i], "a.weight")) experts = i;
      if (has(plan[i], "trunk.weight")) trunk = i;
    }
    ASSERT_LT(experts, plan.size());
    ASSERT_LT(trunk, plan.size());
    auto late = plan[experts];
    std::sort(late.begin(), late.end());
    EXPECT_EQ(late, (std::vector<std::string>{"a.bias", "a.weight", "b.bias", "b.weight"}));
    if (u == Unused::Exact) {
      EXPECT_LT(experts, trunk);
    } else {
      EXPECT_EQ(experts, plan.size() - 1);
    }
  }
}

// no_sync micro-batches use expert a, the synced one only expert b: a's
// accumulated gradient must still be averaged, as in one large batch.
TEST(GradSync, NoSyncGradientOfAParameterUnusedInTheSyncedStep) {
  auto& pg = world();
  const int n = pg->getSize();
  for (const auto& [u, in_place] : kExpertModes) {
    SCOPED_TRACE(mode_name(u, in_place));
    auto [ref, m] = twin_experts(23);
    GradSync sync(m->named_parameters(), pg, GradSyncOptions().unused(u));
    for (int round = 0; round < 5; ++round) {  // later rounds run on a re-planned (late) layout
      std::vector<at::Tensor> gs;
      for (int k = 0; k < 3; ++k) gs.push_back(global_batch(6, 900 + 10 * round + k));
      ref->zero_grad(/*set_to_none=*/!in_place);
      m->zero_grad(/*set_to_none=*/!in_place);
      at::Tensor total;
      for (int k = 0; k < 3; ++k) {
        ref->step = k < 2 ? 0 : 1;
        for (int r = 0; r < n; ++r) {
          auto l = ref(shard(gs[k], r)) / n;
          total = total.defined() ? total + l : l;
        }
      }
      total.backward();
      {
        auto guard = sync.no_sync();
        m->step = 0;
        for (int k = 0; k < 2; ++k) {
          auto loss = m(shard(gs[k], pg->getRank()));
          if (u == Unused::Exact) sync.prepare_for_backward({loss});
          loss.backward();
        }
      }
      m->step = 1;
      auto loss = m(shard(gs[2], pg->getRank()));
      if (u == Unused::Exact) sync.prepare_for_backward({loss});
      loss.backward();
      expect_grads_match(m, ref, 1e-5, 1e-8, "round " + std::to_string(round));
    }
  }
}

// Exact agrees early on the used set; a gradient for a late parameter that
// the outputs given to prepare_for_backward do not reach is an error on every
// rank, not a silently unreduced gradient.
TEST(GradSync, ExactRejectsAGradientItWasNotToldAbout) {
  auto& pg = world();
  torch::manual_seed(22);
  Experts m;
  GradSync sync(m->named_parameters(), pg, GradSyncOptions().unused(Unused::Exact));
  auto x = at::randn({kB, 6}, at::kDouble);
  for (int step = 0; step < 3; ++step) {  // settles the late set: both experts late
    m->step = step;
    auto loss = m(x);
    sync.prepare_for_backward({loss});
    loss.backward();
  }
  ASSERT_EQ(sync.replans(), 1);
  m->step = 0;  // uses expert a ...
  auto loss = m(x);
  sync.prepare_for_backward({m->b(x).sum()});  // ... but announces b
  try {
    loss.backward();
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("do not reach it (on this rank: "), std::string::npos) << msg;
    EXPECT_NE(msg.find("'a.weight'"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("'b.weight'"), std::string::npos) << msg;
  }
}

TEST(GradSync, UnusedOffNamesTheParameter) {
  auto& pg = world();
  if (pg->getSize() < 1) GTEST_SKIP();
  torch::manual_seed(1);
  Branchy m;
  GradSync sync(m->named_parameters(), pg, GradSyncOptions().unused(Unused::Off));
  // Every rank takes the left branch: "never" and "right" get no gradient on
  // any rank, so every rank raises (nobody waits on a peer).
  try {
    m(at::randn({kB, 6}, at::kDouble), 0).backward();
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("never.weight"), std::string::npos) << e.what();
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
                GradSyncOptions().bucket_cap_mb(0.002).first_bucket_mb(0.002));
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
  torch::nn::Sequential m(torch::nn::Linear(4, pg->getRank() == 1 ? 5 : 4), torch::nn::Linear(4, 4));
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
    EXPECT_NE(std::string(e.what()).find("parameters that require grad but rank 1 has 4"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace

// The hooks stay on the parameters after GradSync is gone: a later backward
// must be a plain local one (no call into freed memory, no communication).
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
