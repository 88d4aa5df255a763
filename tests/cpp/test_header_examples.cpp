// The examples of our public headers, run as they stand there: each
// examples/NAME.inc is the text between "// [example NAME]" and
// "// [end example]" of its header (cmake/ddpxExamples.cmake), included
// where the context it names is set up; then its result is checked.
// Under mpirun with 2 and 3 ranks.
#include <ddpx/comm.h>
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

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

TEST(HeaderExamples, CommSumsOverTheGroups) {
  const int rank = ddpx::test::world()->getRank();
  const int size = ddpx::test::world()->getSize();
#include "examples/comm.inc"
  const double want = rank < 2 ? 2.0 * size : size;
  EXPECT_TRUE(at::equal(t[0], at::full({4}, want))) << t[0];
  EXPECT_EQ(pg->getSize(), size);
  EXPECT_EQ(gloo->getSize(), size);
}
