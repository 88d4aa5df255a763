// A model scripted by Python (tests/python/export_codec_model.py, a ctest
// fixture) and loaded by this C++ program gives what the eager C++ call gives.
// Under mpirun with 2 and 3 ranks; the op's group "" is the ddpx_mpi world.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ddpx/ops.h>
#include <gtest/gtest.h>
#include <torch/script.h>

#include <cstdlib>

namespace {

TEST(CodecJit, ScriptedModelMatchesEagerCall) {
  const char* path = std::getenv("DDPX_CODEC_MODEL");
  ASSERT_NE(path, nullptr) << "DDPX_CODEC_MODEL must name the scripted model (ctest sets it)";
  auto module = torch::jit::load(path);
  auto world =
      ddpx::compressed_allreduce(at::ones({1}), "none", "", "");  // first call makes the group
  ASSERT_TRUE(at::equal(world, at::ones({1})));
  for (const std::string codec : {"none", "fp16", "bf16", "int8", "topk:0.25", "powersgd:2"}) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(17);
    auto x = at::randn({12, 9}, g, at::kFloat);
    auto scripted = module.forward({x, codec, std::string("")}).toTensor();
    auto eager = ddpx::compressed_allreduce(2.0 * x + 1.0, codec, "", "");
    EXPECT_TRUE(at::equal(scripted, eager)) << codec;
    EXPECT_EQ(scripted.sizes(), x.sizes());
  }
  // Keyed state behaves the same through the script: key "s" then key "e"
  // have identical histories.
  auto x = at::randn({12, 9});
  for (int i = 0; i < 3; ++i) {
    auto scripted = module.forward({x, std::string("topk:0.1"), std::string("s")}).toTensor();
    auto eager = ddpx::compressed_allreduce(2.0 * x + 1.0, "topk:0.1", "e", "");
    EXPECT_TRUE(at::equal(scripted, eager)) << "call " << i;
  }
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
