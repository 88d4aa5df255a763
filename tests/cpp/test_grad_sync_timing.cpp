// GradSync's timing-aware planning under mpirun (2 and 3 ranks): buckets cut
// where backward pauses, learnt from arrival times, without changing results.
#include <chrono>
#include <thread>

#include "grad_sync_test_models.h"

namespace {

using ddpx::GradSync;
using ddpx::GradSyncOptions;
using namespace ddpx::test::grad_sync;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Identity whose backward takes 40 ms: a slow layer between two others.
struct SlowBackward : torch::autograd::Function<SlowBackward> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static variable_list backward(AutogradContext*, variable_list g) {
    std::this_thread::sleep_for(std::chrono::milliseconds(40));
    return g;
  }
};

// `wide`'s 32 MB of weight gradient arrive first; `narrow`'s come 40 ms later.
struct PausedImpl : torch::nn::Module {
  torch::nn::Linear narrow{nullptr}, wide{nullptr};
  PausedImpl() {
    narrow = register_module("narrow", torch::nn::Linear(8, 64));
    wide = register_module("wide", torch::nn::Linear(64, 1 << 16));
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) {
    return wide(SlowBackward::apply(torch::tanh(narrow(x)))).pow(2).mean();
  }
};
TORCH_MODULE(Paused);

// One 200 MB bucket cap would hold wide.weight and narrow's parameters
// together, so wide.weight's bytes would wait out the pause. After two timed
// steps the plan cuts the bucket at the pause (one re-plan, then no churn),
// and every step's gradients equal one process's on the whole batch.
TEST(GradSync, BackwardPauseCutsTheBucketOnceAndStaysExact) {
  auto& pg = world();
  const int n = pg->getSize(), r = pg->getRank();
  torch::manual_seed(11);
  Paused ref;
  torch::manual_seed(11);
  Paused m;
  GradSync sync(m->named_parameters(), pg, GradSyncOptions().bucket_cap_mb(200));
  auto together = [&sync] {
    for (const auto& b : sync.bucket_plan()) {
      const bool w = std::find(b.begin(), b.end(), "wide.weight") != b.end();
      const bool a = std::find(b.begin(), b.end(), "narrow.weight") != b.end();
      if (w) return a;
    }
    return false;
  };
  ASSERT_TRUE(together()) << "the size-only plan should share the bucket";
  for (int step = 0; step < 6; ++step) {
    auto g = global_batch(8, 900 + step);
    ref->zero_grad();
    backward_global(ref, g, n);
    m->zero_grad();
    m(shard(g, r)).backward();
    auto rp = ref->named_parameters();
    for (const auto& item : m->named_parameters()) {
      EXPECT_TRUE(at::allclose(item.value().grad(), rp[item.key()].grad(), 1e-5, 1e-8))
          << item.key() << " step " << step;
    }
  }
  EXPECT_EQ(sync.replans(), 1);
  EXPECT_FALSE(together()) << "wide.weight should have gone out before the pause ended";
}

}  // namespace
