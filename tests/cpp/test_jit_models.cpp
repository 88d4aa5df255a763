// ddpx-train's view of the models the build scripted (torchscript_models/,
// exported to DDPX_MODELS_DIR): torch::jit::load each file, read the
// attributes the trainer reads, run forward and backward from C++ and see a
// gradient reach every parameter. Python compares the same models to eager
// and to the ATen variant (tests/python/test_models.py).
#include <ddpx/ops.h>
#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace {

struct ModelCase {
  std::string name;
  std::string input;     // module.attr("ddpx_input")
  int64_t num_classes;   // module.attr("num_classes")
  size_t param_tensors;  // pinned: a change here is a change of the model
  int64_t param_count;
};

std::ostream& operator<<(std::ostream& os, const ModelCase& c) { return os << c.name; }

torch::jit::Module load(const std::string& name) {
  const char* dir = std::getenv("DDPX_MODELS_DIR");
  if (dir == nullptr) throw std::runtime_error("DDPX_MODELS_DIR is not set (run via ctest)");
  return torch::jit::load(std::string(dir) + "/" + name + ".pt");
}

// A batch of n as the trainer makes one: images, or token ids of the
// exported sizes (0 = padding, so some words are padding).
at::Tensor make_input(const torch::jit::Module& m, int64_t n) {
  if (m.attr("ddpx_input").toStringRef() == "image") return torch::randn({n, 1, 28, 28});
  const int64_t s = m.attr("sentences").toInt(), w = m.attr("words").toInt();
  return torch::randint(0, m.attr("vocab_size").toInt(), {n, s, w}, torch::kLong) *
         (torch::rand({n, s, w}) < 0.8).to(torch::kLong);
}

class JitModels : public ::testing::TestWithParam<ModelCase> {};

TEST_P(JitModels, AttributesAreThere) {
  const ModelCase& c = GetParam();
  torch::jit::Module m = load(c.name);
  EXPECT_EQ(m.attr("ddpx_input").toStringRef(), c.input);
  EXPECT_EQ(m.attr("num_classes").toInt(), c.num_classes);
  EXPECT_FALSE(m.attr("aten_reference").toBool());  // the build exports the ddpx variant
  if (c.input == "tokens") {
    EXPECT_EQ(m.attr("vocab_size").toInt(), 2000);
    EXPECT_EQ(m.attr("sentences").toInt(), 8);
    EXPECT_EQ(m.attr("words").toInt(), 12);
  }
  int64_t count = 0;
  for (const auto& p : m.parameters()) count += p.numel();
  EXPECT_EQ(m.parameters().size(), c.param_tensors);
  EXPECT_EQ(count, c.param_count);
}

TEST_P(JitModels, ForwardBackwardFromCpp) {
  const ModelCase& c = GetParam();
  torch::jit::Module m = load(c.name);
  m.train();
  torch::manual_seed(0);
  for (int64_t n : {1, 5}) {
    for (auto p : m.parameters()) p.mutable_grad() = at::Tensor();
    const at::Tensor out = m.forward({make_input(m, n)}).toTensor();
    ASSERT_EQ(out.sizes().vec(), (std::vector<int64_t>{n, c.num_classes})) << "batch " << n;
    ASSERT_EQ(out.scalar_type(), at::kFloat);
    ASSERT_TRUE(out.isfinite().all().item<bool>());
    torch::nn::functional::cross_entropy(out, torch::arange(n) % c.num_classes).backward();
    for (const auto& p : m.named_parameters()) {
      const at::Tensor& g = p.value.grad();
      ASSERT_TRUE(g.defined()) << p.name << ", batch " << n;
      EXPECT_TRUE(g.isfinite().all().item<bool>()) << p.name;
      EXPECT_GT(g.abs().sum().item<double>(), 0.0) << p.name << ", batch " << n;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Exported, JitModels,
                         ::testing::Values(ModelCase{"lenet", "image", 10, 10, 61706},
                                           ModelCase{"mlp", "image", 10, 6, 535818},
                                           ModelCase{"han", "tokens", 4, 25, 286212}),
                         [](const auto& info) { return info.param.name; });

TEST(JitModelsErrors, BadInputNamesTheArgument) {
  ASSERT_FALSE(ddpx::version().empty());  // the plugin is linked: its ops are registered
  torch::jit::Module lenet = load("lenet");
  try {
    lenet.forward({torch::randn({2, 3, 28, 28})});
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("x must be [N, 1, 28, 28]"), std::string::npos)
        << e.what();
  }
  try {
    load("han").forward({torch::full({1, 8, 12}, 2000, torch::kLong)});
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("vocab_size=2000"), std::string::npos) << e.what();
  }
}

}  // namespace
