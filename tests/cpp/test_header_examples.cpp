// The examples of our public headers, run as they stand there: each
// examples/NAME.inc is the text between "// [example NAME]" and
// "// [end example]" of its header (cmake/ddpxExamples.cmake), included
// where the context it names is set up; then its result is checked.
// Under mpirun with 2 and 3 ranks.
#include <ddpx/amp.h>
#include <ddpx/comm.h>
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "mpi_test_util.h"

namespace {

constexpr int64_t kRows = 6;  // each rank's part of the batch

// The whole batch: rank r's part is rows [r * kRows, (r + 1) * kRows).
std::pair<at::Tensor, at::Tensor> global_batch(int64_t ranks) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(7);
  return {at::randn({ranks * kRows, 5}, g), at::randn({ranks * kRows, 3}, g)};
}

}  // namespace

// grad_sync.h's loop on this rank's part equals one process's SGD on the
// whole batch (mean losses over equal parts: the mean of the parts'
// gradients is the whole batch's gradient).
TEST(HeaderExamples, GradSyncTrainsAsOneProcessOnTheWholeBatch) {
  const int rank = ddpx::test::world()->getRank();
  const int size = ddpx::test::world()->getSize();
  const auto [gx, gy] = global_batch(size);
  torch::manual_seed(3 + rank);  // different initial values: GradSync sends rank 0's
  torch::nn::Linear model(5, 3);
  torch::manual_seed(3);
  torch::nn::Linear ref(5, 3);
  const at::Tensor x = gx.narrow(0, rank * kRows, kRows);
  const at::Tensor y = gy.narrow(0, rank * kRows, kRows);
  {
#include "examples/grad_sync.inc"
  }
  torch::optim::SGD opt(ref->parameters(), 0.1);
  for (int step = 0; step < 10; ++step) {
    opt.zero_grad();
    torch::mse_loss(ref->forward(gx), gy).backward();
    opt.step();
  }
  EXPECT_TRUE(at::allclose(model->weight, ref->weight, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(model->bias, ref->bias, 1e-5, 1e-6));
}

// The distance of `got` from the float32 one-process run `want`, relative
// to how far `want` moved from `start`.
double relative_miss(const at::Tensor& got, const at::Tensor& want, const at::Tensor& start) {
  return (got.to(at::kFloat) - want).norm().item<double>() / (want - start).norm().item<double>();
}

// amp.h's float16 loop (autocast, scaler, GradSync): near one float32
// process on the whole batch (within 1% of the distance moved; float16's
// matmuls round at ~5e-4) that takes as many steps as the scaler did not
// skip. (The batch is the same every step; a step skipped while the scale
// calibrates -- the first, with 3 ranks' data -- halves the scale, and the
// scale grows only after 2000 steps.)
TEST(HeaderExamples, GradScalerTrainsNearOneFloat32Process) {
  const int rank = ddpx::test::world()->getRank();
  const int size = ddpx::test::world()->getSize();
  const auto [gx, gy] = global_batch(size);
  torch::manual_seed(3 + rank);
  torch::nn::Linear model(5, 3);
  torch::manual_seed(3);
  torch::nn::Linear ref(5, 3);
  const at::Tensor start = ref->weight.detach().clone();
  const at::Tensor x = gx.narrow(0, rank * kRows, kRows);
  const at::Tensor y = gy.narrow(0, rank * kRows, kRows);
  int skipped = 0;
  {
#include "examples/grad_scaler.inc"
    skipped = static_cast<int>(std::lround(std::log2(65536.0 / scaler.get_scale())));
  }
  EXPECT_LE(skipped, 2);
  torch::optim::SGD opt(ref->parameters(), 0.1);
  for (int step = skipped; step < 10; ++step) {
    opt.zero_grad();
    torch::mse_loss(ref->forward(gx), gy).backward();
    opt.step();
  }
  EXPECT_LT(relative_miss(model->weight.detach(), ref->weight.detach(), start), 0.01);
}

// The README's two mixed-precision loops: the float32 masters near one
// float32 process on the whole batch (bfloat16 forward: within 5% of the
// distance moved; float16: 1%), the parameters their rounding.
TEST(HeaderExamples, ReadmeMixedPrecisionTrainsNearOneFloat32Process) {
  const int rank = ddpx::test::world()->getRank();
  const int size = ddpx::test::world()->getSize();
  const auto [gx, gy] = global_batch(size);
  const at::Tensor x = gx.narrow(0, rank * kRows, kRows);
  const at::Tensor y = gy.narrow(0, rank * kRows, kRows);
  auto pg = ddpx::test::world_pg();
  for (const bool fp16 : {false, true}) {
    SCOPED_TRACE(fp16 ? "readme_fp16_scaled" : "readme_mixed_precision");
    torch::manual_seed(3 + rank);
    torch::nn::Linear model(5, 3);
    torch::manual_seed(3);
    torch::nn::Linear ref(5, 3);
    const at::Tensor start = ref->weight.detach().clone();
    at::Tensor master;
    int skipped = 0;  // (as in GradScalerTrainsNearOneFloat32Process)
    if (fp16) {
#include "examples/readme_fp16_scaled.inc"
      master = sync.master_parameters()[0];
      skipped = static_cast<int>(std::lround(std::log2(65536.0 / scaler.get_scale())));
      EXPECT_LE(skipped, 2);
    } else {
#include "examples/readme_mixed_precision.inc"
      master = sync.master_parameters()[0];
    }
    EXPECT_EQ(model->weight.scalar_type(), fp16 ? at::kHalf : at::kBFloat16);
    EXPECT_TRUE(at::equal(model->weight.detach(), master.to(model->weight.scalar_type())));
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (fp16) {
      opt = std::make_unique<torch::optim::SGD>(ref->parameters(), 0.1);
    } else {
      opt = std::make_unique<torch::optim::AdamW>(ref->parameters(), 1e-2);
    }
    for (int step = skipped; step < 10; ++step) {
      opt->zero_grad();
      torch::mse_loss(ref->forward(gx), gy).backward();
      opt->step();
    }
    EXPECT_LT(relative_miss(master, ref->weight.detach(), start), fp16 ? 0.01 : 0.05);
  }
}

TEST(HeaderExamples, CommSumsOverTheGroups) {
  const int rank = ddpx::test::world()->getRank();
  const int size = ddpx::test::world()->getSize();
#include "examples/comm.inc"
  const double want = rank < 2 ? 2.0 * size : size;
  EXPECT_TRUE(at::equal(t[0], at::full({4}, want))) << t[0];
  EXPECT_EQ(pg->getSize(), size);
  EXPECT_EQ(gloo->getSize(), size);
}
