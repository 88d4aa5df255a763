// GradSyncOptions::shard's checkpoints, mpirun with 2 and 3 ranks: each
// rank saves its shard of the optimizer state (GradSync::optimizer_shard);
// a run resumes from the shards at the same or another world size (the
// state re-split by bytes), or moves between sharded and unsharded runs;
// a missing or repeated shard is an error.
#include <ATen/CPUGeneratorImpl.h>
#include <ddpx/comm.h>
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <numeric>
#include <sstream>
#include <string>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "grad_sync_train_harness.h"

namespace {

using namespace ddpx_overlap_test;
using ddpx::Shard;
using ddpx::test::all_bytes;
using ddpx::test::error_of;

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

}  // namespace
