// A C++ program runs a TorchScript model that calls ddpx::tiled_conv2d
// (scripted and saved by export_conv_model.py at test time; its path comes in
// DDPX_CONV_JIT_MODEL) and must reproduce the output and a gradient that
// Python computed. Also drives the public C++ entry ddpx::tiled_conv2d.
#include <ddpx/ops.h>
#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cstdlib>

namespace {

torch::jit::Module load_model() {
  const char* path = std::getenv("DDPX_CONV_JIT_MODEL");
  if (path == nullptr) throw std::runtime_error("DDPX_CONV_JIT_MODEL is not set (run via ctest)");
  return torch::jit::load(path);
}

TEST(JitConv, ScriptedModelMatchesPython) {
  torch::jit::Module m = load_model();
  const at::Tensor x = m.attr("example_input").toTensor();
  const at::Tensor expected = m.attr("expected_output").toTensor();
  const at::Tensor out = m.forward({x}).toTensor();
  ASSERT_EQ(out.sizes(), expected.sizes());
  // float32, same kernels; only BLAS threading may reorder sums.
  EXPECT_TRUE(at::allclose(out, expected, 1e-5, 1e-5)) << (out - expected).abs().max();
}

TEST(JitConv, ScriptedModelTrainsInCpp) {
  torch::jit::Module m = load_model();
  const at::Tensor x = m.attr("example_input").toTensor();
  at::Tensor w2 = m.attr("w2").toTensor();
  ASSERT_TRUE(w2.requires_grad());
  m.forward({x}).toTensor().sum().backward();
  const at::Tensor expected = m.attr("expected_grad_w2").toTensor();
  ASSERT_TRUE(w2.grad().defined());
  EXPECT_TRUE(at::allclose(w2.grad(), expected, 1e-4, 1e-4)) << (w2.grad() - expected).abs().max();
}

TEST(JitConv, CppEntryMatchesAtenWithAutograd) {
  torch::manual_seed(0);
  auto opts = torch::TensorOptions().dtype(torch::kDouble);
  at::Tensor x = torch::randn({2, 4, 17, 13}, opts).requires_grad_();
  at::Tensor w = torch::randn({6, 2, 3, 3}, opts).requires_grad_();
  at::Tensor b = torch::randn({6}, opts).requires_grad_();
  at::Tensor y = ddpx::tiled_conv2d(x, w, b, {2, 1}, {1, 2}, {1, 2}, 2);
  at::Tensor r = at::conv2d(x, w, b, {2, 1}, {1, 2}, {1, 2}, 2);
  ASSERT_TRUE(at::allclose(y, r, 1e-10, 1e-10));
  auto g = torch::autograd::grad({y.sum()}, {x, w, b});
  auto gr = torch::autograd::grad({r.sum()}, {x, w, b});
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(at::allclose(g[i], gr[i], 1e-10, 1e-10)) << i;
  // Defaults: stride 1, padding 0, dilation 1, groups 1, no bias.
  at::Tensor w1 = torch::randn({3, 4, 2, 2}, opts);
  EXPECT_TRUE(at::allclose(ddpx::tiled_conv2d(x.detach(), w1), at::conv2d(x.detach(), w1)));
}

// The C++ entries of the path ops (issue 26) and a float32 problem on each
// automatic CPU path, through the C++ entry with autograd.
TEST(JitConv, CppPathEntriesAndEachAutoPath) {
  torch::manual_seed(0);
  struct Case {
    std::vector<int64_t> x, w;
    int64_t groups;
    std::string path;
  };
  const std::vector<Case> cases = {
      {{1, 1, 64, 64}, {1, 1, 3, 3}, 1, "direct"},
      {{1, 6, 14, 14}, {16, 6, 5, 5}, 1, "gemm"},
      {{8, 16, 16, 16}, {32, 16, 3, 3}, 1, "aten"},
      {{8, 32, 56, 56}, {32, 1, 5, 5}, 32, "aten/direct"},
  };
  for (const auto& c : cases) {
    at::Tensor x = torch::randn(c.x).requires_grad_();
    at::Tensor w = torch::randn(c.w).requires_grad_();
    const int64_t pad = c.w[3] / 2;
    ASSERT_EQ(ddpx::tiled_conv2d_path(x, w, {1, 1}, {pad, pad}, {1, 1}, c.groups), c.path);
    at::Tensor y = ddpx::tiled_conv2d(x, w, std::nullopt, {1, 1}, {pad, pad}, {1, 1}, c.groups);
    at::Tensor r = at::conv2d(x, w, {}, {1, 1}, {pad, pad}, {1, 1}, c.groups);
    EXPECT_TRUE(at::allclose(y, r, 1e-4, 1e-3)) << c.path;
    auto g = torch::autograd::grad({y.sum()}, {x, w});
    auto gr = torch::autograd::grad({r.sum()}, {x, w});
    for (size_t i = 0; i < 2; ++i) {
      const double scale = std::max(1.0, gr[i].abs().max().item<double>());
      EXPECT_TRUE(at::allclose(g[i], gr[i], 1e-4, 1e-4 * scale)) << c.path << " grad " << i;
    }
  }
  EXPECT_EQ(ddpx::fused_gru_path(torch::empty({5, 16, 3}), 64), "serial");
  EXPECT_EQ(ddpx::fused_gru_path(torch::empty({5, 64, 3}), 256), "batch-parallel:4");
}

TEST(JitConv, BadArgumentIsNamed) {
  auto x = torch::randn({1, 4, 8, 8});
  try {
    ddpx::tiled_conv2d(x, torch::randn({2, 3, 3, 3}));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("weight.size(1) * groups"), std::string::npos) << e.what();
  }
}

}  // namespace
