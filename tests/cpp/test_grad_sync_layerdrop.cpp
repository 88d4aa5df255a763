// GradSync under layer dropping (declare_unused), mpirun with 2 and 3 ranks:
// a pattern shared by every rank keeps the dropped blocks off the wire (the
// bytes are exactly the kept blocks'), never re-plans, and gives the
// gradients of one process running the whole batch with the same pattern;
// a per-rank pattern, not declared, is today's unused-parameter handling
// and matches one process with each rank's pattern; and the misuses
// (ranks that disagree, a declared block that runs, no_sync) fail on every
// rank with an error that says so.
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "grad_sync_test_models.h"

namespace {

using ddpx::GradSync;
using ddpx::GradSyncOptions;
using ddpx::Unused;
using namespace ddpx::test::grad_sync;

constexpr int kBlocks = 4;

struct BlockImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  BlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 8));
  }
  at::Tensor forward(const at::Tensor& x, double scale) {
    return x + scale * fc2(torch::tanh(fc1(x)));
  }
};
TORCH_MODULE(Block);

// embed -> blocks.0 .. blocks.3 (residual, skipped where scale is 0) -> head.
struct StackImpl : torch::nn::Module {
  torch::nn::Linear embed{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  std::vector<double> scales = std::vector<double>(kBlocks, 1.0);
  StackImpl() {
    embed = register_module("embed", torch::nn::Linear(6, 8));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int b = 0; b < kBlocks; ++b) blocks->push_back(Block());
    head = register_module("head", torch::nn::Linear(8, 2));
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = embed(x);
    for (int b = 0; b < kBlocks; ++b) {
      if (scales[b] != 0) h = blocks[b]->as<BlockImpl>()->forward(h, scales[b]);
    }
    return head(h).pow(2).mean();
  }
};
TORCH_MODULE(Stack);

// The one-process reference and the model under GradSync, same weights.
std::pair<Stack, Stack> twin_stacks() {
  torch::manual_seed(7);
  Stack ref;
  torch::manual_seed(7);
  return {ref, Stack()};
}

std::vector<std::string> all_units() {
  std::vector<std::string> u;
  for (int b = 0; b < kBlocks; ++b) u.push_back("blocks." + std::to_string(b) + ".");
  return u;
}

// Step s's pattern (`stream` 0: shared, else per rank): none dropped at
// step 0, all at step 1, then mixed masks; kept blocks scaled by 2 when any
// is dropped (as 1/keep-probability would).
std::vector<double> pattern(int step, int stream) {
  const int mask = step == 0 ? 0 : step == 1 ? 15 : (step * 5 + 3 * stream + 1) % 16;
  std::vector<double> s(kBlocks);
  for (int b = 0; b < kBlocks; ++b) s[b] = (mask >> b) & 1 ? 0.0 : (mask ? 2.0 : 1.0);
  return s;
}

std::vector<std::string> dropped_of(const std::vector<double>& scales) {
  std::vector<std::string> d;
  for (int b = 0; b < kBlocks; ++b) {
    if (scales[b] == 0) d.push_back("blocks." + std::to_string(b) + ".");
  }
  return d;
}

// The bytes the kept parameters put on the wire (float64, no codec).
int64_t kept_bytes(Stack& m, const std::vector<double>& scales) {
  int64_t n = 0;
  for (const auto& p : m->named_parameters()) {
    bool dropped = false;
    for (const auto& u : dropped_of(scales)) dropped = dropped || p.key().rfind(u, 0) == 0;
    if (!dropped) n += p.value().numel();
  }
  return n * 8;
}

// Shared pattern, declared: 8 steps against one process on the whole batch.
void run_shared(GradSyncOptions opts, bool zero_in_place, bool check_bytes) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  auto [ref, m] = twin_stacks();
  GradSync sync(m->named_parameters(), pg, opts);
  const auto plan0 = sync.bucket_plan();
  for (int step = 0; step < 8; ++step) {
    const auto scales = pattern(step, 0);
    const auto where = "step " + std::to_string(step);
    ref->scales = m->scales = scales;
    ref->zero_grad(!zero_in_place);
    backward_global(ref, global_batch(6, 300 + step), n);
    m->zero_grad(!zero_in_place);
    sync.declare_unused(dropped_of(scales));
    auto loss = m(shard(global_batch(6, 300 + step), r));
    if (opts.unused_ == Unused::Exact) sync.prepare_for_backward({loss});
    loss.backward();
    expect_grads_match(m, ref, 1e-5, 1e-10, where);
    if (check_bytes) EXPECT_EQ(sync.last_step().bytes_reduced, kept_bytes(m, scales)) << where;
    EXPECT_EQ(sync.last_step().unused_mispredictions, 0) << where;
  }
  EXPECT_EQ(sync.replans(), 0) << "dropping blocks must not re-plan";
  EXPECT_EQ(sync.bucket_plan(), plan0);
}

GradSyncOptions unit_buckets() {
  return GradSyncOptions()
      .bucket_cap_mb(0.0004)
      .first_bucket_mb(0.0002)
      .drop_units(all_units())
      .timed_plans(false);
}

TEST(GradSyncLayerDrop, SharedPatternMatchesOneProcessAndSendsOnlyKeptBlocks) {
  run_shared(unit_buckets(), /*zero_in_place=*/false, /*check_bytes=*/true);
}

TEST(GradSyncLayerDrop, SharedPatternZeroGradInPlace) {
  run_shared(unit_buckets(), /*zero_in_place=*/true, /*check_bytes=*/true);
}

TEST(GradSyncLayerDrop, SharedPatternUnderUnusedOffAndExact) {
  run_shared(unit_buckets().unused(Unused::Off), false, true);
  run_shared(unit_buckets().unused(Unused::Exact), false, true);
}

TEST(GradSyncLayerDrop, DropUnitsGiveEachBlockItsOwnBuckets) {
  GradSync sync(Stack()->named_parameters(), world(),
                GradSyncOptions().bucket_cap_mb(25).drop_units(all_units()));
  const auto plan = sync.bucket_plan();
  ASSERT_EQ(plan.size(), static_cast<size_t>(kBlocks + 2)) << "head, 4 blocks, embed";
  for (const auto& bucket : plan) {
    const auto unit = bucket.front().substr(0, bucket.front().find('.', 7) + 1);
    for (const auto& name : bucket) EXPECT_EQ(name.rfind(unit, 0), 0u) << name << " in " << unit;
  }
}

TEST(GradSyncLayerDrop, WithoutUnitsAPartlyDroppedBucketSendsItsKeptRuns) {
  // One bucket holds everything: a dropped block is a hole in it. (Untimed
  // plans: with room under the cap, the timing rule may cut this bucket on
  // a busy machine, which has nothing to do with dropping.)
  run_shared(GradSyncOptions().bucket_cap_mb(25).first_bucket_mb(25).timed_plans(false), false,
             true);
}

TEST(GradSyncLayerDrop, CodecSendsOnlyKeptBlocksCompressed) {
  auto& pg = world();
  auto [ref, m] = twin_stacks();
  GradSync sync(m->named_parameters(), pg, unit_buckets().codec("fp16"));
  for (int step = 0; step < 6; ++step) {
    const auto scales = pattern(step, 0);
    ref->scales = m->scales = scales;
    ref->zero_grad();
    backward_global(ref, global_batch(6, 500 + step), pg->getSize());
    m->zero_grad();
    sync.declare_unused(dropped_of(scales));
    m(shard(global_batch(6, 500 + step), pg->getRank())).backward();
    expect_grads_match(m, ref, 2e-2, 1e-3, "fp16 step " + std::to_string(step));
    // bytes_reduced counts the slots sent (float64 here); the codec's own
    // count is in the profile.
    EXPECT_EQ(sync.last_step().bytes_reduced, kept_bytes(m, scales));
  }
  EXPECT_EQ(sync.replans(), 0);
}

// Gradient accumulation under one pattern per optimizer step: the no_sync
// micro-batches and the synced one skip the same blocks, which are declared
// before the synced backward; the sum matches one process on all of it.
TEST(GradSyncLayerDrop, NoSyncAccumulationWithTheStepsPattern) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  auto [ref, m] = twin_stacks();
  GradSync sync(m->named_parameters(), pg, unit_buckets());
  for (int step = 2; step < 6; ++step) {
    const auto scales = pattern(step, 0);
    ref->scales = m->scales = scales;
    ref->zero_grad();
    m->zero_grad();
    for (int micro = 0; micro < 3; ++micro) {
      const auto g = global_batch(6, 1000 + 10 * step + micro);
      backward_global(ref, g, n);
      if (micro < 2) {
        auto guard = sync.no_sync();
        m(shard(g, r)).backward();
      } else {
        sync.declare_unused(dropped_of(scales));
        m(shard(g, r)).backward();
      }
    }
    expect_grads_match(m, ref, 1e-5, 1e-10, "no_sync step " + std::to_string(step));
    EXPECT_EQ(sync.last_step().bytes_reduced, kept_bytes(m, scales));
  }
}

TEST(GradSyncLayerDrop, PerRankPatternUndeclaredMatchesOneProcessWithEachRanksPattern) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  for (Unused mode : {Unused::Predict, Unused::Exact}) {
    auto [ref, m] = twin_stacks();
    GradSync sync(m->named_parameters(), pg, unit_buckets().unused(mode));
    for (int step = 0; step < 8; ++step) {
      const auto g = global_batch(6, 700 + step);
      ref->zero_grad();
      at::Tensor total;
      for (int k = 0; k < n; ++k) {
        ref->scales = pattern(step, k + 1);
        auto l = ref(shard(g, k)) / n;
        total = total.defined() ? total + l : l;
      }
      total.backward();
      m->zero_grad();
      m->scales = pattern(step, r + 1);
      auto loss = m(shard(g, r));
      if (mode == Unused::Exact) sync.prepare_for_backward({loss});
      loss.backward();
      expect_grads_match(m, ref, 1e-5, 1e-10, "per-rank step " + std::to_string(step));
    }
  }
}

// A misuse fails the step on every rank; the next step is a normal one.
void expect_step_fails_then_recovers(GradSync& sync, Stack& m, const std::vector<double>& run,
                                     const std::vector<std::string>& declare,
                                     const std::string& message) {
  m->zero_grad();
  m->scales = run;
  sync.declare_unused(declare);
  try {
    m(shard(global_batch(6, 900), world()->getRank())).backward();
    ADD_FAILURE() << "expected an error containing: " << message;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
  m->zero_grad();
  m->scales = pattern(0, 0);
  sync.declare_unused({});
  m(shard(global_batch(6, 901), world()->getRank())).backward();
  EXPECT_EQ(sync.last_step().bytes_reduced, kept_bytes(m, m->scales));
}

TEST(GradSyncLayerDrop, RanksThatDeclareDifferentBlocksFailTogether) {
  Stack m;
  GradSync sync(m->named_parameters(), world(), unit_buckets());
  const int r = world()->getRank();
  // Blocks of the same size: sent unchecked, rank 0's block 1 would be
  // averaged with rank 1's block 2.
  auto run = pattern(0, 0);
  run[r == 0 ? 1 : 2] = 0;
  expect_step_fails_then_recovers(sync, m, run, dropped_of(run), "declared different parameters");
}

TEST(GradSyncLayerDrop, ADeclaredBlockThatRunsFailsEveryRank) {
  Stack m;
  GradSync sync(m->named_parameters(), world(), unit_buckets());
  expect_step_fails_then_recovers(sync, m, pattern(0, 0), {"blocks.2."},
                                  world()->getRank() == 0 ? "'blocks.2." : "declared unused");
}

TEST(GradSyncLayerDrop, BadDeclarationsAreRefusedByName) {
  Stack m;
  GradSync sync(m->named_parameters(), world(), unit_buckets());
  EXPECT_THROW(
      {
        try {
          sync.declare_unused({"blocks.9."});
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("'blocks.9.'"), std::string::npos) << e.what();
          throw;
        }
      },
      c10::Error);
  {
    auto guard = sync.no_sync();
    EXPECT_THROW(sync.declare_unused({"blocks.0."}), c10::Error);
  }
  sync.declare_unused({"blocks.0."});
  EXPECT_THROW(sync.declare_unused({"blocks.1."}), c10::Error) << "twice before one backward";
  m->scales = {0.0, 1.0, 1.0, 1.0};
  m(shard(global_batch(6, 950), world()->getRank())).backward();  // the first declaration holds
  EXPECT_EQ(sync.last_step().bytes_reduced, kept_bytes(m, m->scales));
  EXPECT_THROW(GradSync(m->named_parameters(), world(), GradSyncOptions().drop_units({"nope."})),
               c10::Error);
}

TEST(GradSyncLayerDrop, ADeclaredBlockWithANoSyncGradientFailsEveryRank) {
  Stack m;
  GradSync sync(m->named_parameters(), world(), unit_buckets());
  m->zero_grad();
  m->scales = pattern(0, 0);
  {
    auto guard = sync.no_sync();  // every block runs in this micro-batch
    m(shard(global_batch(6, 960), world()->getRank())).backward();
  }
  m->scales = {1.0, 0.0, 1.0, 1.0};
  sync.declare_unused({"blocks.1."});
  try {
    m(shard(global_batch(6, 961), world()->getRank())).backward();
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no_sync"), std::string::npos) << e.what();
  }
}

}  // namespace
