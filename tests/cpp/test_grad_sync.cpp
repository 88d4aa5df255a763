// GradSync under mpirun (2 and 3 ranks). The reference for every model is
// one process computing the gradient of the whole batch (all ranks' shards):
// N ranks x batch B must give the gradients of 1 process x batch N*B.
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <torch/torch.h>

#include <functional>
#include <map>

#include "mpi_test_util.h"

namespace {

using ddpx::GradSync;
using ddpx::GradSyncOptions;
using ddpx::Unused;

ddpx::comm::ProcessGroupPtr& world() { return ddpx::test::world_pg(); }

constexpr int kB = 4;  // per-rank batch

// Shard of rank r: rows [r*B, (r+1)*B) of a batch every rank can regenerate.
at::Tensor global_batch(int64_t features, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn({world()->getSize() * kB, features}, gen, at::kDouble);
}
at::Tensor shard(const at::Tensor& g, int r) { return g.narrow(0, r * kB, kB); }

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
    for (int branch : {0, 1}) {
      auto loss = m(x, branch);
      if (u == Unused::Exact) sync.prepare_for_backward({loss});
      loss.backward();
      if (branch == 0) {
        ASSERT_TRUE(m->left->weight.grad().is_alias_of(m->trunk->weight.grad())) << "not in a bucket";
      }
    }
    // Reference: the same two steps without GradSync's views (accumulating).
    auto left = m->left->weight.grad();
    torch::manual_seed(11);
    Branchy ref;
    GradSync ref_sync(ref->named_parameters(), pg,
                      GradSyncOptions().unused(u).gradient_as_bucket_view(false));
    for (int branch : {0, 1}) {
      auto loss = ref(x, branch);
      if (u == Unused::Exact) ref_sync.prepare_for_backward({loss});
      loss.backward();
    }
    EXPECT_TRUE(at::equal(left, ref->left->weight.grad()));
    EXPECT_TRUE(at::equal(m->right->weight.grad(), ref->right->weight.grad()));
    EXPECT_GT(left.abs().sum().item<double>(), 0.0) << "left.grad was zeroed";
    EXPECT_FALSE(m->never->weight.grad().defined());
  }
}

struct ExpertsImpl : torch::nn::Module {
  torch::nn::Linear trunk{nullptr}, a{nullptr}, b{nullptr}, head{nullptr};
  int step = 0;
  ExpertsImpl() {
    trunk = register_module("trunk", torch::nn::Linear(6, 6));
    a = register_module("a", torch::nn::Linear(6, 6));
    b = register_module("b", torch::nn::Linear(6, 6));
    head = register_module("head", torch::nn::Linear(6, 2));
    to(at::kDouble);
  }
  // Every rank picks the same expert: a on even steps, b on odd ones.
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(trunk(x));
    return head(torch::relu(step % 2 == 0 ? a(h) : b(h))).pow(2).mean();
  }
};
TORCH_MODULE(Experts);

// One process's gradients for the global batch g at ref's step: the shards'
// losses / n summed (equal shards: the mean over the batch), then backward.
void backward_global(Experts& ref, const at::Tensor& g, int n) {
  at::Tensor total;
  for (int k = 0; k < n; ++k) {
    auto l = ref(shard(g, k)) / n;
    total = total.defined() ? total + l : l;
  }
  total.backward();
}

// m's gradients against ref's: defined alike, and within atol + rtol |want|.
void expect_grads_match(Experts& m, Experts& ref, double rtol, double atol,
                        const std::string& where) {
  auto rp = ref->named_parameters();
  for (const auto& item : m->named_parameters()) {
    const auto& want = rp[item.key()].grad();
    const auto& got = item.value().grad();
    ASSERT_EQ(got.defined(), want.defined()) << item.key() << " " << where;
    if (!want.defined()) continue;
    EXPECT_TRUE(at::allclose(got, want, rtol, atol))
        << item.key() << " " << where << ": max diff " << (got - want).abs().max().item<double>();
  }
}

// The modes the Experts tests run: (unused mode, zero_grad in place). In
// place, .grad is the bucket slot, and an idle expert's must keep its value.
const std::vector<std::pair<Unused, bool>> kExpertModes{
    {Unused::Predict, false}, {Unused::Exact, false}, {Unused::Predict, true}};

std::string mode_name(Unused u, bool in_place) {
  return std::string(u == Unused::Predict ? "Predict" : "Exact") +
         (in_place ? ", zero_grad in place" : "");
}

// Two models with the same initial weights: the one-process reference and
// the one under GradSync.
std::pair<Experts, Experts> twin_experts(uint64_t seed) {
  torch::manual_seed(seed);
  Experts ref;
  torch::manual_seed(seed);
  Experts m;
  return {ref, m};
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
    // The experts share the last (late) bucket; no reliable tensor is with them.
    auto last = sync.bucket_plan().back();
    std::sort(last.begin(), last.end());
    EXPECT_EQ(last, (std::vector<std::string>{"a.bias", "a.weight", "b.bias", "b.weight"}));
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

// A lossy codec on late buckets: the runs sent change with the expert, and
// each layout keeps its own error-feedback state (no size clash), while the
// averages stay within the codec's error of the exact ones.
TEST(GradSync, LossyCodecsOnLateBuckets) {
  auto& pg = world();
  const int n = pg->getSize();
  for (const std::string codec : {"fp16", "int8"}) {
    SCOPED_TRACE(codec);
    auto [ref, m] = twin_experts(24);
    GradSync sync(m->named_parameters(), pg, GradSyncOptions().codec(codec));
    for (int step = 0; step < 8; ++step) {
      ref->step = m->step = step;
      auto g = global_batch(6, 1100 + step);
      ref->zero_grad();
      backward_global(ref, g, n);
      m->zero_grad();
      m(shard(g, pg->getRank())).backward();
      // int8 quantises a whole chunk (here: a bucket) by its largest value,
      // and error feedback adds back the last step's residual: allow a few
      // steps of absmax/127 over all gradients; fp16: its relative precision.
      double absmax = 0;
      for (const auto& p : ref->parameters()) {
        if (p.grad().defined()) absmax = std::max(absmax, p.grad().abs().max().item<double>());
      }
      const double tol = codec == "int8" ? 4 * absmax / 127 : 4e-3 * absmax;
      expect_grads_match(m, ref, 0, tol, "step " + std::to_string(step));
    }
    EXPECT_EQ(sync.replans(), 1);
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

// Two towers whose execution order flips at step kFlip: backward order changes.
struct FlipImpl : torch::nn::Module {
  std::vector<torch::nn::Linear> tower;
  int step = 0;
  static constexpr int kFlip = 3;
  FlipImpl() {
    for (int i = 0; i < 6; ++i) {
      tower.push_back(register_module("t" + std::to_string(i), torch::nn::Linear(16, 16)));
    }
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = x;
    for (int i = 0; i < 6; ++i) h = torch::tanh(tower[step < kFlip ? i : 5 - i](h));
    return h.pow(2).mean();
  }
};
TORCH_MODULE(Flip);

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
    at::Tensor total;
    for (int k = 0; k < n; ++k) {
      auto l = ref(shard(g, k)) / n;
      total = total.defined() ? total + l : l;
    }
    total.backward();
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

// Per parameter: the sum of its gradients over steps.
using GradSums = std::map<std::string, at::Tensor>;

// Adds mod's gradients to sum, those `ref` has this step (if given): a
// globally unused parameter's .grad is left as it was, not a new gradient.
void add_grads(torch::nn::Module& mod, GradSums& sum, torch::nn::Module* ref = nullptr) {
  auto rp = (ref ? ref : &mod)->named_parameters();
  for (const auto& item : mod.named_parameters()) {
    if (!rp[item.key()].grad().defined()) continue;
    auto& s = sum[item.key()];
    s = s.defined() ? s + item.value().grad() : item.value().grad().clone();
  }
}

// float32 on the wire, summed over a dozen steps.
void expect_sums_match(GradSums& got, const GradSums& want) {
  for (const auto& [name, w] : want) {
    const double scale = w.abs().max().item<double>();
    ASSERT_TRUE(got[name].defined()) << name;
    EXPECT_TRUE(at::allclose(got[name], w, 1e-4, 1e-5 * scale))
        << name << ": max error " << (got[name] - w).abs().max().item<double>() << " of " << scale;
  }
}

// Error feedback across a re-plan: the flip re-plans the buckets (new keys,
// new layouts), and the residuals the old buckets held must reach the same
// parameters. With zero gradients afterwards, the codecs send their residuals
// out (top-k 1/4 of the entries per step, int8 1/127 of the rest), so the sum
// of the synced gradients over all steps must come to the sum of the true
// averages: a dropped residual would be missing from it for good.
TEST(GradSync, ReplanCarriesErrorFeedbackResiduals) {
  auto& pg = world();
  const int n = pg->getSize();
  for (const std::string codec : {"topk:0.25", "int8"}) {
    SCOPED_TRACE(codec);
    torch::manual_seed(9);
    Flip ref;
    torch::manual_seed(9);
    Flip m;
    GradSync sync(m->named_parameters(), pg,
                  GradSyncOptions().bucket_cap_mb(0.002).first_bucket_mb(0.002).codec(codec));
    GradSums want, got;
    constexpr int kLive = 8, kDrain = 6;  // the flip at step 3, its re-plan after step 4
    int64_t replans_at_drain = -1;
    for (int step = 0; step < kLive + kDrain; ++step) {
      const bool live = step < kLive;
      ref->step = m->step = step;
      auto g = global_batch(16, 700 + step);
      if (live) {
        ref->zero_grad();
        at::Tensor total;
        for (int k = 0; k < n; ++k) {
          auto l = ref(shard(g, k)) / n;
          total = total.defined() ? total + l : l;
        }
        total.backward();
        add_grads(*ref, want);
      }
      m->zero_grad();
      // Drain steps: zero gradients, but every hook still fires.
      (m(shard(g, pg->getRank())) * (live ? 1.0 : 0.0)).backward();
      add_grads(*m, got);
      if (step == kLive - 1) replans_at_drain = sync.replans();
    }
    EXPECT_EQ(replans_at_drain, 1);
    EXPECT_EQ(sync.replans(), 1);
    expect_sums_match(got, want);
  }
}

// The same across a re-plan of late buckets, whose codec state is kept per
// run of used slots (one key per layout seen): the alternating experts, with
// a re-plan forced (load_state) once their late bucket has sent both layouts.
// Before the late set settles (steps 0-1) the idle expert sits in a reliable
// bucket, unused everywhere: its slot sends its residual, and that is owed
// again, not dropped with the result.
TEST(GradSync, ReplanCarriesTheResidualsOfLateRuns) {
  auto& pg = world();
  const int n = pg->getSize();
  for (const std::string codec : {"topk:0.25", "int8"}) {
    SCOPED_TRACE(codec);
    auto [ref, m] = twin_experts(31);
    GradSync sync(m->named_parameters(), pg, GradSyncOptions().codec(codec));
    GradSums want, got;
    constexpr int kLive = 8, kDrain = 10;  // each expert drains on every other step
    for (int step = 0; step < kLive + kDrain; ++step) {
      const double live = step < kLive ? 1.0 : 0.0;
      ref->step = m->step = step;
      auto g = global_batch(6, 900 + step);
      ref->zero_grad();
      at::Tensor total;
      for (int k = 0; k < n; ++k) {
        auto l = ref(shard(g, k)) * (live / n);
        total = total.defined() ? total + l : l;
      }
      total.backward();
      add_grads(*ref, want);
      m->zero_grad();
      (m(shard(g, pg->getRank())) * live).backward();
      add_grads(*m, got, ref.get());
      if (step == 5) sync.load_state(sync.state());  // re-plans: new keys
    }
    EXPECT_EQ(sync.replans(), 1);  // the late set's; load_state's is not counted
    expect_sums_match(got, want);
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
