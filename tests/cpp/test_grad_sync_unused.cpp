// GradSync with parameters unused on some ranks or on every rank (Predict
// and Exact), under mpirun (2 and 3 ranks): late buckets, idle slots kept
// off the wire, .grad left as DDP leaves it, and the errors when a gradient
// comes that was not announced or never comes.
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

#include "grad_sync_test_models.h"

namespace {

using ddpx::GradSync;
using ddpx::GradSyncOptions;
using ddpx::Unused;
using namespace ddpx::test::grad_sync;

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
  GradSync sync(m->named_parameters(), pg, GradSyncOptions().timed_plans(false));
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
    GradSync sync(m->named_parameters(), pg, GradSyncOptions().unused(u).timed_plans(false));
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
  GradSync sync(m->named_parameters(), pg,
                GradSyncOptions().unused(Unused::Exact).timed_plans(false));
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
}  // namespace
