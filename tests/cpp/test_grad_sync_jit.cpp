// GradSync over a TorchScript module (the torch::jit::Module constructor),
// under mpirun with 2 and 3 ranks. The model is scripted by
// export_grad_sync_model.py at test time (path in DDPX_GRAD_SYNC_MODEL). The
// reference is one process running the same module on the whole batch (all
// ranks' shards): N ranks x batch B must give its gradients.
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <map>

#include "mpi_test_util.h"

namespace {

constexpr int64_t kB = 3;  // per-rank batch (odd)

ddpx::comm::ProcessGroupPtr& world() { return ddpx::test::world_pg(); }

torch::jit::Module load_model() {
  const char* path = std::getenv("DDPX_GRAD_SYNC_MODEL");
  if (path == nullptr) throw std::runtime_error("DDPX_GRAD_SYNC_MODEL is not set (run via ctest)");
  torch::jit::Module m = torch::jit::load(path);
  m.train();
  return m;
}

at::Tensor loss_of(torch::jit::Module& m, const at::Tensor& x, int64_t step) {
  return m.forward({x, step}).toTensor();
}

void zero_grad(torch::jit::Module& m, bool set_to_none) {
  for (const auto& p : m.parameters()) {
    if (set_to_none) {
      p.mutable_grad().reset();
    } else if (p.grad().defined()) {
      p.grad().zero_();
    }
  }
}

class GradSyncJit : public ::testing::TestWithParam<bool> {};  // param: zero_grad in place

TEST_P(GradSyncJit, MatchesOneProcessWithUnusedHeadsAndBroadcast) {
  const bool in_place = GetParam();
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  torch::jit::Module ref = load_model();
  torch::jit::Module m = load_model();
  {
    // Other ranks start from different values: the constructor must
    // broadcast rank 0's parameters and buffers.
    torch::NoGradGuard no_grad;
    if (r != 0) {
      for (const auto& p : m.parameters()) p.add_(r);
      m.attr("scale").toTensor().fill_(r);
    }
  }
  ddpx::GradSync sync(m, pg, ddpx::GradSyncOptions().bucket_cap_mb(0.001).first_bucket_mb(0.0005));
  EXPECT_TRUE(at::equal(m.attr("scale").toTensor(), ref.attr("scale").toTensor()));
  const auto plan = sync.bucket_plan();
  ASSERT_FALSE(plan.empty());
  EXPECT_EQ(plan.back().back(), "a.weight") << "last bucket: first layer (reverse order)";
  // The scripted Embedding(sparse=True) is found: a bucket of its own from
  // the start, which sends rows (at most 2 ids x kB samples of 16 doubles
  // and an index, and the count), not its 2560 dense bytes.
  const auto e_bucket = std::find(plan.begin(), plan.end(), std::vector<std::string>{"e.weight"});
  ASSERT_NE(e_bucket, plan.end());

  for (int64_t step = 0; step < 5; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(40 + step);
    const at::Tensor batch = at::randn({n * kB, 8}, gen, at::kDouble);
    zero_grad(ref, !in_place);
    at::Tensor total;
    for (int k = 0; k < n; ++k) {
      auto l = loss_of(ref, batch.narrow(0, k * kB, kB), step) / n;
      total = total.defined() ? total + l : l;
    }
    total.backward();
    zero_grad(m, !in_place);
    loss_of(m, batch.narrow(0, r * kB, kB), step).backward();
    if (step == 0) {  // (the plan it ran on; a re-plan may follow)
      EXPECT_LE(sync.last_step().buckets[e_bucket - plan.begin()].bytes, 8 + 2 * kB * (16 * 8 + 8));
    }

    std::map<std::string, at::Tensor> want;
    for (const auto& item : ref.named_parameters()) want[item.name] = item.value.grad();
    for (const auto& item : m.named_parameters()) {
      const at::Tensor& w = want.at(item.name);
      const at::Tensor& got = item.value.grad();
      // Unused everywhere this step (c on odd steps, d on even): untouched
      // by GradSync, exactly like the reference's .grad.
      ASSERT_EQ(w.defined(), got.defined()) << item.name << " step " << step;
      if (w.defined()) {
        EXPECT_EQ(got.is_sparse(), w.is_sparse()) << item.name << " step " << step;
        const at::Tensor g = got.to_dense(), want_dense = w.to_dense();
        EXPECT_TRUE(at::allclose(g, want_dense, 1e-6, 1e-9))
            << item.name << " step " << step << " max diff " << (g - want_dense).abs().max();
      }
    }
  }
  EXPECT_EQ(sync.last_step().step, 5);
  EXPECT_GT(sync.last_step().hook_calls, 0);
}

INSTANTIATE_TEST_SUITE_P(ZeroGrad, GradSyncJit, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "InPlace" : "SetToNone"; });

TEST(GradSyncJitBadInput, NullProcessGroupIsNamed) {
  torch::jit::Module m = load_model();
  try {
    ddpx::GradSync sync(m, ddpx::comm::ProcessGroupPtr());
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("pg is null"), std::string::npos) << e.what();
  }
}

}  // namespace
