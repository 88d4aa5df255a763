// GradSync with CUDA parameters (label gpu; run by scripts/gpu_check.sh, and
// skipped with a message where no GPU is visible). Two ranks share one GPU,
// so the backends are Gloo and ddpx_mpi (NCCL needs a GPU per rank).
//
// Backward runs on a non-default stream, as a trainer that overlaps its data
// loading does, and the first layer's gradients come after a long chain of
// kernels: a reduction not ordered after the stream that wrote its slots
// reads last step's values, and an optimizer not ordered after the reduction
// reads the local gradient. Every step is compared with one process on the
// whole batch (double precision: the sums are exact to rounding).
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <ddpx/amp.h>
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include "mpi_test_util.h"

namespace {

struct SlowMLPImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  SlowMLPImpl() {
    a = register_module("a", torch::nn::Linear(64, 512));
    b = register_module("b", torch::nn::Linear(512, 512));
    c = register_module("c", torch::nn::Linear(512, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::tanh(a(x));
    // Backward through these matmuls delays a's gradients by milliseconds of
    // queued kernels after b's and c's buckets have launched.
    for (int i = 0; i < 24; ++i) h = torch::tanh(b(h)) * 0.5 + h * 0.5;
    return c(h).pow(2).mean();
  }
};
TORCH_MODULE(SlowMLP);

// overlap: None, the trainer steps after backward; Optimizer and NextForward,
// GradSync steps each bucket as its average lands (queued on `side` after
// the reduction), and the next forward waits at each parameter's gate
// (NextForward), which orders `side` after the update.
void expect_matches_one_process(const std::string& backend, bool zero_in_place,
                                ddpx::Overlap overlap = ddpx::Overlap::None) {
  DDPX_SKIP_WITHOUT_GPU();
  auto pg = ddpx::comm::make(backend);
  const int r = pg->getRank(), n = pg->getSize();
  const at::Device dev(at::kCUDA, 0);
  constexpr int64_t kB = 16;
  torch::manual_seed(7);
  SlowMLP ref;
  ref->to(dev, at::kDouble);
  torch::manual_seed(7);
  SlowMLP model;
  model->to(dev, at::kDouble);
  ddpx::GradSync sync(
      model->named_parameters(), pg,
      ddpx::GradSyncOptions().bucket_cap_mb(0.5).first_bucket_mb(0.1).overlap(overlap));
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  torch::optim::SGD opt(model->parameters(), sgd);
  torch::optim::SGD ref_opt(ref->parameters(), sgd);
  const bool steps_itself = overlap == ddpx::Overlap::None;
  if (!steps_itself) sync.set_optimizer(opt);
  // Everything from here runs on `side`, a non-blocking stream: nothing
  // orders it after the default stream's set-up but this.
  torch::cuda::synchronize();
  const c10::Stream side = c10::impl::VirtualGuardImpl(at::kCUDA).getStreamFromGlobalPool(dev);
  c10::StreamGuard guard(side);
  for (int step = 0; step < 4; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
    auto batch = at::randn({n * kB, 64}, gen, at::kDouble).to(dev);
    ref_opt.zero_grad(/*set_to_none=*/!zero_in_place);
    at::Tensor total;
    for (int k = 0; k < n; ++k) {
      auto l = ref(batch.narrow(0, k * kB, kB)) / n;
      total = total.defined() ? total + l : l;
    }
    total.backward();
    if (steps_itself) opt.zero_grad(/*set_to_none=*/!zero_in_place);
    // (NextForward: the gates of the last update, one call for the model.)
    sync.wait_ready(model->parameters());
    model(batch.narrow(0, r * kB, kB)).backward();
    auto rp = ref->named_parameters();
    // .cpu() runs on `side`: it sees the average (or the update) only if
    // GradSync ordered `side` after the reductions (and the updates).
    auto expect_close = [&](const at::Tensor& mine, const at::Tensor& theirs,
                            const std::string& what) {
      const auto got = mine.cpu(), want = theirs.cpu();
      EXPECT_TRUE(at::allclose(got, want, 1e-9, 1e-12))
          << backend << " " << what << " step " << step << ": max diff "
          << (got - want).abs().max().item<double>();
    };
    if (!steps_itself) {
      ref_opt.step();
      sync.synchronize();  // every update queued, and `side` after them
      for (const auto& item : model->named_parameters()) {
        expect_close(item.value().detach(), rp[item.key()].detach(), item.key());
      }
      continue;
    }
    for (const auto& item : model->named_parameters()) {
      expect_close(item.value().grad(), rp[item.key()].grad(), item.key() + ".grad");
    }
    opt.step();
    ref_opt.step();
  }
  // Same parameters on every rank after the steps (the collective orders
  // itself after `side`, this thread's current stream).
  for (const auto& p : model->parameters()) {
    std::vector<at::Tensor> t{p.detach().clone()};
    const auto mine = p.detach().cpu();
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    pg->allreduce(t, o)->wait();
    EXPECT_TRUE(at::equal(t[0].cpu(), mine));
  }
}

TEST(GradSyncCuda, GlooOnASideStreamMatchesOneProcess) {
  expect_matches_one_process("gloo", false);
}

TEST(GradSyncCuda, GlooZeroGradInPlace) { expect_matches_one_process("gloo", true); }

TEST(GradSyncCuda, DdpxMpiOnASideStreamMatchesOneProcess) {
  expect_matches_one_process("ddpx_mpi", false);
}

TEST(GradSyncCuda, OptimizerPerBucketOnASideStreamMatchesOneProcess) {
  expect_matches_one_process("ddpx_mpi", false, ddpx::Overlap::Optimizer);
}

TEST(GradSyncCuda, NextForwardGatedOnASideStreamMatchesOneProcess) {
  expect_matches_one_process("ddpx_mpi", false, ddpx::Overlap::NextForward);
  expect_matches_one_process("gloo", false, ddpx::Overlap::NextForward);
}

// Mixed precision on the GPU (issue 63): float16 CUDA parameters with
// float32 masters (on the GPU too), GradSync stepping under a GradScaler,
// an inf in the last rank's gradient at step 2: every rank skips that step
// alike (the masters keep their values), the others step; the parameters
// are always the masters rounded, the same on every rank; the scale halves
// once. NextForward: the next forward's gates wait for the rounded copies.
void mixed_precision_skips_alike(const std::string& backend, ddpx::Overlap overlap) {
  DDPX_SKIP_WITHOUT_GPU();
  auto pg = ddpx::comm::make(backend);
  const int r = pg->getRank(), n = pg->getSize();
  const at::Device dev(at::kCUDA, 0);
  torch::manual_seed(8);
  SlowMLP model;
  model->to(dev);
  ddpx::GradScaler scaler(ddpx::GradScalerOptions().init_scale(1024));
  ddpx::GradSync sync(model->named_parameters(), pg,
                      ddpx::GradSyncOptions()
                          .bucket_cap_mb(0.5)
                          .first_bucket_mb(0.1)
                          .mixed_precision(at::kHalf, at::kFloat)
                          .overlap(overlap));
  torch::optim::SGD opt(model->parameters(), 0.05);
  sync.set_optimizer(opt, scaler);
  for (int step = 0; step < 4; ++step) {
    const at::Tensor before = sync.master_parameters()[0].clone();
    sync.wait_ready(model->parameters());
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * step + r);
    const at::Tensor x = at::randn({16, 64}, gen).to(dev, at::kHalf);
    at::Tensor loss = model(x).to(at::kFloat);
    if (step == 2 && r == n - 1) {
      at::Tensor mask = torch::zeros_like(model->a->weight);
      mask[3][5] = std::numeric_limits<float>::infinity();
      loss = loss + (model->a->weight * mask).sum().to(at::kFloat);
    }
    scaler.scale(loss).backward();
    sync.synchronize();
    EXPECT_EQ(sync.last_step().skipped, step == 2) << "step " << step;
    const at::Tensor after = sync.master_parameters()[0];
    EXPECT_EQ(after.device(), dev);
    EXPECT_EQ(at::equal(before, after), step == 2) << "step " << step;
    EXPECT_TRUE(at::equal(model->a->weight.detach(), after.to(at::kHalf)));
    std::vector<at::Tensor> t{after.clone()};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    pg->allreduce(t, o)->wait();
    EXPECT_TRUE(at::equal(t[0].cpu(), after.cpu())) << "step " << step;
  }
  EXPECT_EQ(scaler.get_scale(), 512.0);
}

TEST(GradSyncCuda, MixedPrecisionWithTheScalerSkipsAlikeOnTheGpu) {
  mixed_precision_skips_alike("ddpx_mpi", ddpx::Overlap::Optimizer);
  mixed_precision_skips_alike("gloo", ddpx::Overlap::NextForward);
}

}  // namespace
