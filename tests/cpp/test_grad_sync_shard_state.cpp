// GradSyncOptions::shard, mpirun with 2 and 3 ranks: who owns what (the
// byte ranges of hooks/shard_map.h), the state and gradient memory each rank
// keeps (optimizer state for its own elements only; Gradients keeps no .grad
// and frees buckets as they are reduced), and the misuses, whose errors name
// both options. The sharded runs against unsharded: test_grad_sync_shard.cpp.
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "grad_sync_train_harness.h"
#include "hooks/shard_map.h"

namespace {

using namespace ddpx_overlap_test;
using ddpx::Shard;
using ddpx::test::error_of;

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
