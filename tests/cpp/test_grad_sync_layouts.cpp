// GradSync on parameters beyond one dense dtype (mpirun, 2 and 3 ranks):
// sparse COO gradients (Embedding(sparse=true)) and several dtypes in one
// model, against one process on the whole batch.
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "grad_sync_test_models.h"

namespace {

using ddpx::GradSync;
using ddpx::GradSyncOptions;
using namespace ddpx::test::grad_sync;

// A sparse embedding bag (rows looked up per sample, summed) and a dense head.
struct BagImpl : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};
  BagImpl() {
    emb = register_module("emb",
                          torch::nn::Embedding(torch::nn::EmbeddingOptions(40, 6).sparse(true)));
    head = register_module("head", torch::nn::Linear(6, 3));
    to(at::kDouble);
  }
  // ids: [batch, 5] row indices
  at::Tensor forward(const at::Tensor& ids) { return head(emb(ids).sum(1)).pow(2).mean(); }
};
TORCH_MODULE(Bag);

// Rank r's ids touch rows shared with other ranks and rows of its own, with
// repeats (an uncoalesced sparse gradient).
at::Tensor global_ids(int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(0, 30, {world()->getSize() * kB, 5}, gen, at::kLong);
}

// Modes: (zero_grad in place, gradient_as_bucket_view).
TEST(GradSync, SparseEmbeddingGradientsMatchOneProcessAndStaySparse) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  for (const auto& [in_place, as_view] :
       std::vector<std::pair<bool, bool>>{{false, true}, {true, true}, {false, false}}) {
    const std::string mode = std::string(in_place ? "zero in place" : "set_to_none") +
                             (as_view ? "" : ", no bucket view");
    torch::manual_seed(5);
    Bag ref;
    torch::manual_seed(5);
    Bag m;
    GradSync sync(m->named_parameters(), pg, GradSyncOptions().gradient_as_bucket_view(as_view));
    torch::optim::SGD opt(m->parameters(), 0.05);
    torch::optim::SGD ref_opt(ref->parameters(), 0.05);
    for (int step = 0; step < 4; ++step) {
      const auto ids = global_ids(300 + step);
      ref_opt.zero_grad(!in_place);
      backward_global(ref, ids, n);
      opt.zero_grad(!in_place);
      m(ids.narrow(0, r * kB, kB)).backward();
      const auto& got = m->emb->weight.grad();
      const auto& want = ref->emb->weight.grad();
      ASSERT_TRUE(got.is_sparse())
          << mode << " step " << step << ": the optimizer must get a sparse gradient";
      EXPECT_TRUE(at::allclose(got.to_dense(), want.to_dense(), 1e-10, 1e-12))
          << mode << " step " << step;
      EXPECT_TRUE(at::allclose(m->head->weight.grad(), ref->head->weight.grad(), 1e-10, 1e-12))
          << mode << " step " << step;
      opt.step();
      ref_opt.step();
    }
    for (const auto& item : m->named_parameters()) {
      EXPECT_TRUE(at::allclose(item.value(), ref->named_parameters()[item.key()], 1e-10, 1e-12))
          << mode << " " << item.key();
    }
  }
}

// float32, float64 and bfloat16 layers in one model: one bucket per dtype,
// each reduced in its own dtype. Three branches on the same input, so no
// layer's gradient carries another dtype's rounding.
struct MixedImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  MixedImpl() {
    a = register_module("a", torch::nn::Linear(8, 3));
    b = register_module("b", torch::nn::Linear(8, 3));
    c = register_module("c", torch::nn::Linear(8, 3));
    b->to(at::kDouble);
    c->to(at::kBFloat16);
  }
  at::Tensor forward(const at::Tensor& x) {
    return torch::tanh(a(x.to(at::kFloat))).pow(2).mean().to(at::kDouble) +
           torch::tanh(b(x)).pow(2).mean() +
           torch::tanh(c(x.to(at::kBFloat16))).pow(2).mean().to(at::kDouble);
  }
};
TORCH_MODULE(Mixed);

TEST(GradSync, ParametersOfSeveralDtypesMatchOneProcess) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  torch::manual_seed(9);
  Mixed ref;
  torch::manual_seed(9);
  Mixed m;
  GradSync sync(m->named_parameters(), pg);
  for (int step = 0; step < 3; ++step) {
    const auto g = global_batch(8, 500 + step);
    ref->zero_grad();
    backward_global(ref, g, n);
    m->zero_grad();
    m(shard(g, r)).backward();
    for (const auto& item : m->named_parameters()) {
      const auto& want = ref->named_parameters()[item.key()].grad();
      const auto& got = item.value().grad();
      ASSERT_EQ(got.scalar_type(), item.value().scalar_type()) << item.key();
      // bfloat16 keeps 8 bits of mantissa: the ranks' sum rounds apart from
      // one process's, by an ulp of the largest addend (a small element may
      // be the difference of larger ones).
      const bool bf16 = got.scalar_type() == at::kBFloat16;
      const double scale = want.abs().max().item<double>();
      const double rtol = bf16 ? 2e-2 : 1e-5, atol = bf16 ? 2e-2 * scale : 1e-8;
      EXPECT_TRUE(at::allclose(got.to(at::kDouble), want.to(at::kDouble), rtol, atol))
          << item.key() << " step " << step << ": max diff "
          << (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
    }
  }
}

}  // namespace
