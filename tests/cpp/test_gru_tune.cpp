// ops/fused_gru_tune.h, fused_gru's benchmark mode, on the CPU with ATen's
// GRU as both candidates (the choice between cuDNN and ours is made on CUDA
// only; tests/python/test_fused_gru_cuda.py runs it there): the faster
// candidate wins and is kept, the measuring call returns outputs whose own
// backward still works, the measurement's backward leaves .grad alone, an
// inference call runs no backward, and the key tells problems apart. And
// `auto`'s rule on CUDA (GruAutoPath).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <thread>
#include <vector>

#include "ops/fused_gru_cuda_path.h"
#include "ops/fused_gru_tune.h"

namespace ddpx::detail {
namespace {

constexpr int64_t kT = 5, kB = 3, kI = 4, kH = 6;

struct Gru {
  at::Tensor x;
  std::vector<at::Tensor> params;
  Gru() {
    at::manual_seed(0);
    const auto o = at::TensorOptions().dtype(at::kDouble);
    x = at::randn({kT, kB, kI}, o).requires_grad_();
    for (const auto& shape :
         std::vector<std::vector<int64_t>>{{3 * kH, kI}, {3 * kH, kH}, {3 * kH}, {3 * kH}}) {
      params.push_back(at::randn(shape, o).requires_grad_());
    }
  }
  GruOutputs run() const {
    auto [y, h] =
        at::gru(x, at::zeros({1, kB, kH}, x.options()), params, true, 1, 0.0, true, false, false);
    return {y, h};
  }
  std::vector<at::Tensor> leaves() const {
    std::vector<at::Tensor> l{x};
    l.insert(l.end(), params.begin(), params.end());
    return l;
  }
  ConvTuneKey key(bool grad) const {
    return gru_tune_key(x, params, true, 1, false, false, false, grad);
  }
};

TEST(GruTune, FasterWinsItsOutputsBackpropagateAndGradIsUntouched) {
  conv_path_tuning_clear();
  const Gru g;
  std::vector<int> runs(2, 0);
  const auto [y, h] = gru_tune(
      g.key(true), c10::Device(c10::kCPU), 2,
      [&](int i) {
        ++runs[i];
        if (i == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        return g.run();
      },
      g.leaves());
  EXPECT_EQ(conv_tuned_choice(g.key(true)), 1);
  EXPECT_GE(runs[0], 2);  // warm-up and one timed call at least, each
  EXPECT_GE(runs[1], 2);
  // The measurement ran the backward without accumulating into .grad.
  for (const at::Tensor& p : g.leaves()) EXPECT_FALSE(p.grad().defined());
  // The returned outputs' graph is still there; their backward gives what
  // one plain call's does.
  const auto [ry, rh] = g.run();
  const auto want = torch::autograd::grad({ry.sum() + rh.sum()}, g.leaves());
  (y.sum() + h.sum()).backward();
  const auto leaves = g.leaves();
  for (size_t i = 0; i < leaves.size(); ++i) {
    ASSERT_TRUE(leaves[i].grad().defined()) << i;
    EXPECT_TRUE(at::allclose(leaves[i].grad(), want[i], 1e-12, 1e-12)) << i;
  }
  EXPECT_TRUE(at::allclose(y, ry, 0, 0));
}

TEST(GruTune, InferenceRunsNoBackward) {
  conv_path_tuning_clear();
  const Gru g;
  at::NoGradGuard no_grad;
  // (outputs that do not require grad: a backward through them would throw)
  const auto [y, h] =
      gru_tune(g.key(false), c10::Device(c10::kCPU), 2, [&](int) { return g.run(); }, {});
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(conv_tuned_choice(g.key(false)).has_value());
  EXPECT_FALSE(conv_tuned_choice(g.key(true)).has_value());  // (training is another problem)
}

TEST(GruTune, KeyTellsProblemsApart) {
  const Gru g;
  const ConvTuneKey base = g.key(true);
  EXPECT_EQ(base, g.key(true));
  EXPECT_FALSE(base == gru_tune_key(g.x, g.params, true, 2, false, false, false, true));
  EXPECT_FALSE(base == gru_tune_key(g.x, g.params, true, 1, true, false, false, true));
  EXPECT_FALSE(base == gru_tune_key(g.x, g.params, true, 1, false, true, false, true));
  EXPECT_FALSE(base == gru_tune_key(g.x, g.params, true, 1, false, false, true, true));
  EXPECT_FALSE(base ==
               gru_tune_key(g.x.narrow(0, 0, 4), g.params, true, 1, false, false, false, true));
  EXPECT_FALSE(base ==
               gru_tune_key(g.x.to(at::kFloat), g.params, true, 1, false, false, false, true));
  // (tiled_conv2d's keys start with a device type, never with -2)
  EXPECT_EQ(base.fields.front(), -2);
}

// `auto` on CUDA (ops/fused_gru_cuda_path.h): the H200's measurements as a
// rule, and our kernel only where its plan fits the device (asked of the
// query libddpx_cuda.so installs; here one that records what it was asked).
TEST(GruAutoPath, FollowsTheMeasuredRuleAndAsksWhetherThePlanFits) {
  EXPECT_TRUE(gru_persistent_beats_cudnn(256, 1, 32, at::kFloat, false));
  EXPECT_TRUE(gru_persistent_beats_cudnn(1024, 4, 32, at::kFloat, true));  // (latency-bound)
  EXPECT_TRUE(gru_persistent_beats_cudnn(512, 16, 32, at::kFloat, false));
  EXPECT_FALSE(gru_persistent_beats_cudnn(512, 16, 32, at::kFloat, true));
  EXPECT_FALSE(gru_persistent_beats_cudnn(1024, 16, 32, at::kFloat, false));
  EXPECT_FALSE(gru_persistent_beats_cudnn(256, 64, 32, at::kFloat, false));
  EXPECT_FALSE(gru_persistent_beats_cudnn(64, 1, 32, at::kFloat, false));
  EXPECT_FALSE(gru_persistent_beats_cudnn(256, 1, 32, at::kHalf, false));  // (not measured)
  EXPECT_FALSE(gru_persistent_beats_cudnn(256, 0, 32, at::kFloat, false));
  EXPECT_TRUE(gru_persistent_beats_cudnn(256, 1, 16, at::kFloat, false));
  EXPECT_FALSE(gru_persistent_beats_cudnn(256, 1, 15, at::kFloat, false));  // (few launches saved)

  static int64_t asked_hidden = 0, asked_batch = 0;
  static bool fits = true;
  set_gru_persistent_query([](int, int64_t hidden, int64_t batch, c10::ScalarType) {
    asked_hidden = hidden;
    asked_batch = batch;
    return fits;
  });
  const auto x = [](std::vector<int64_t> shape) { return at::zeros(shape, at::kFloat); };
  EXPECT_EQ(gru_auto_path(x({17, 3, 5}), 256, false), GruCudaPath::kFused);
  EXPECT_EQ(asked_hidden, 256);
  EXPECT_EQ(asked_batch, 3);
  EXPECT_EQ(gru_auto_path(x({3, 17, 5}), 256, true), GruCudaPath::kFused);  // batch first
  EXPECT_EQ(asked_batch, 3);
  EXPECT_EQ(gru_auto_path(x({17, 5}), 1024, false), GruCudaPath::kFused);  // unbatched
  EXPECT_EQ(asked_batch, 1);
  EXPECT_EQ(gru_auto_path(x({17, 64, 5}), 256, false), GruCudaPath::kCudnn);
  EXPECT_EQ(gru_auto_path(x({3, 2, 5}), 256, false), GruCudaPath::kCudnn);  // 3 steps
  EXPECT_EQ(gru_auto_path(x({0, 3, 5}), 256, false), GruCudaPath::kCudnn);  // (empty)
  fits = false;
  EXPECT_EQ(gru_auto_path(x({17, 3, 5}), 256, false), GruCudaPath::kCudnn);
  set_gru_persistent_query(nullptr);
  fits = true;
  EXPECT_EQ(gru_auto_path(x({17, 3, 5}), 256, false), GruCudaPath::kCudnn);  // (no query)
}

}  // namespace
}  // namespace ddpx::detail
