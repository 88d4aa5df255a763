// GradSync on parameters beyond one dense dtype (mpirun, 2 and 3 ranks):
// sparse COO gradients (Embedding(sparse=true)) and several dtypes in one
// model, against one process on the whole batch.
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <tuple>

#include "grad_sync_test_models.h"
#include "hooks/sparse_reduce.h"

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

// Two sparse tables and a dense head: `big` (5000 rows) of which a step
// touches a few, and `small` (10 rows) which every rank touches whole, and
// which a sample may skip (`use_small` false: it gets no gradient).
struct TablesImpl : torch::nn::Module {
  torch::nn::Embedding big{nullptr}, small{nullptr};
  torch::nn::Linear head{nullptr};
  TablesImpl() {
    big = register_module("big",
                          torch::nn::Embedding(torch::nn::EmbeddingOptions(5000, 8).sparse(true)));
    small = register_module("small",
                            torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 6).sparse(true)));
    head = register_module("head", torch::nn::Linear(14, 2));
    to(at::kDouble);
  }
  // ids: [batch, 10]: 5 rows of big, then 5 of small
  at::Tensor forward(const at::Tensor& ids, bool use_small = true) {
    auto b = big(ids.narrow(1, 0, 5)).sum(1);
    auto s = use_small && !small_last ? small(ids.narrow(1, 5, 5)).sum(1)
                                      : at::zeros({ids.size(0), 6}, b.options());
    auto loss = head(at::cat({b, s}, 1)).pow(2).mean();
    // small looked up last, so backward starts with it: its gradient
    // arrives first, in the hook that starts the step.
    if (!use_small || !small_last) return loss;
    return loss * (1 + small(ids.narrow(1, 5, 5)).pow(2).mean());
  }
  bool small_last = false;
};
TORCH_MODULE(Tables);

// Rank r's rows: big's spread over the table, small's all 10 of them.
at::Tensor table_ids(int r, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 7 * r);
  auto big = at::randint(0, 5000, {kB, 5}, gen, at::kLong);
  auto small = (at::arange(kB * 5, at::kLong) + r).remainder(10).view({kB, 5});
  return at::cat({big, small}, 1);
}

// The bytes bucket b of the last step put on the wire, b the bucket that
// holds `name` alone (-1: none does).
int64_t own_bucket_bytes(const GradSync& sync, const std::string& name) {
  const auto plan = sync.bucket_plan();
  for (size_t b = 0; b < plan.size(); ++b) {
    if (plan[b] == std::vector<std::string>{name}) return sync.last_step().buckets[b].bytes;
  }
  return -1;
}

// After the first step shows them sparse, each table gets a bucket of its
// own (one re-plan, then none) and travels as rows: big's few, small's as a
// dense all-reduce, where every rank's rows would cost more.
TEST(GradSync, SparseGradientsTravelAsRowsInBucketsOfTheirOwn) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  // (zero_grad in place, small's gradient first, the tables declared sparse)
  for (const auto& [in_place, small_last, declared] :
       std::vector<std::tuple<bool, bool, bool>>{{false, false, false},
                                                 {true, false, false},
                                                 {false, true, false},
                                                 {false, false, true}}) {
    SCOPED_TRACE(std::string(in_place ? "zero in place" : "set_to_none") +
                 (small_last ? ", small's gradient first" : "") + (declared ? ", declared" : ""));
    torch::manual_seed(3);
    Tables ref;
    torch::manual_seed(3);
    Tables m;
    ref->small_last = m->small_last = small_last;
    // Declared: sparse buckets from the first step (one rank's declaration
    // is enough: the constructor takes the union).
    GradSync sync(m->named_parameters(), pg,
                  GradSyncOptions().timed_plans(false).sparse_params(
                      declared && r == 0 ? std::vector<std::string>{"big.weight", "small.weight"}
                                         : std::vector<std::string>{}));
    torch::optim::SGD opt(m->parameters(), 0.05);
    torch::optim::SGD ref_opt(ref->parameters(), 0.05);
    for (int step = 0; step < 5; ++step) {
      ref_opt.zero_grad(!in_place);
      for (int k = 0; k < n; ++k) (ref(table_ids(k, 40 + step)) / n).backward();
      opt.zero_grad(!in_place);
      m(table_ids(r, 40 + step)).backward();
      expect_grads_match(m, ref, 1e-10, 1e-12, "step " + std::to_string(step));
      if (step > 0 || declared) {
        // big: at most kB * 5 rows of 8 doubles and one index each, plus the
        // row count; its dense table is 320000 bytes.
        const int64_t big = own_bucket_bytes(sync, "big.weight");
        EXPECT_GT(big, 8) << "step " << step;
        EXPECT_LE(big, 8 + kB * 5 * (8 * 8 + 8)) << "step " << step;
        // small: 10 rows from each rank cost more than its 480 dense bytes.
        EXPECT_EQ(own_bucket_bytes(sync, "small.weight"), 8 + 10 * 6 * 8) << "step " << step;
      }
      opt.step();
      ref_opt.step();
    }
    EXPECT_EQ(sync.replans(), declared ? 0 : 1);
    // The profile counts the rows with the head's 30 doubles: per step
    // (median of 4 sparse steps and the dense first one) small's 488 bytes
    // and big's 8 to 8 + 20 rows of 72.
    const double bytes = sync.profile().bytes_sent;
    EXPECT_GE(bytes, 240 + 488 + 8 + 72);
    EXPECT_LE(bytes, 240 + 488 + 8 + kB * 5 * 72);
    for (const auto& item : m->named_parameters()) {
      EXPECT_TRUE(at::allclose(item.value(), ref->named_parameters()[item.key()], 1e-10, 1e-12))
          << item.key();
    }
  }
}

TEST(GradSync, SparseParamsNamesAnUnknownParameter) {
  Tables m;
  m->head->bias.set_requires_grad(false);
  for (const std::string name : {"emb.weight", "head.bias"}) {
    try {
      GradSync sync(m->named_parameters(), world(), GradSyncOptions().sparse_params({name}));
      ADD_FAILURE() << "no error for " << name;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("sparse_params names '" + name + "'"), std::string::npos)
          << e.what();
    }
  }
}

// A sparse table some ranks skip contributes nothing from them; one that no
// rank touched keeps its .grad; one touched only under no_sync contributes
// what accumulated -- in every unused mode, with sparse buckets.
TEST(GradSync, SparseTablesUnusedOnSomeRanksOrAccumulatedStayExact) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  for (Unused u : {Unused::Predict, Unused::Exact}) {
    SCOPED_TRACE(u == Unused::Predict ? "Predict" : "Exact");
    torch::manual_seed(4);
    Tables ref;
    torch::manual_seed(4);
    Tables m;
    GradSync sync(m->named_parameters(), pg, GradSyncOptions().unused(u));
    // Per step, who uses small: everyone (twice, to plan sparse buckets),
    // rank 0 only, nobody, then everyone again.
    auto uses = [](int step, int k) { return step < 2 || step == 4 || (step == 2 && k == 0); };
    for (int step = 0; step < 5; ++step) {
      const std::string where = "step " + std::to_string(step);
      ref->zero_grad(false);  // in place: an untouched .grad keeps its zeros
      m->zero_grad(false);
      for (int k = 0; k < n; ++k) (ref(table_ids(k, 60 + step), uses(step, k)) / n).backward();
      auto loss = m(table_ids(r, 60 + step), uses(step, r));
      if (u == Unused::Exact) sync.prepare_for_backward({loss});
      loss.backward();
      expect_grads_match(m, ref, 1e-10, 1e-12, where);
      if (step > 0) EXPECT_GE(own_bucket_bytes(sync, "small.weight"), 0) << "sparse: " << where;
      if (step == 3) {
        EXPECT_EQ(m->small->weight.grad()._nnz(), 0) << "untouched: " << where;
      }
    }
    // no_sync: rank 1 (or the only rank) touches small in the first
    // micro-batch; the synced one touches it nowhere.
    const int toucher = n > 1 ? 1 : 0;
    ref->zero_grad(false);
    m->zero_grad(false);
    for (int k = 0; k < n; ++k) {
      (ref(table_ids(k, 90), k == toucher) / n).backward();
      (ref(table_ids(k, 91), false) / n).backward();
    }
    {
      auto guard = sync.no_sync();
      m(table_ids(r, 90), r == toucher).backward();
    }
    auto loss = m(table_ids(r, 91), false);
    if (u == Unused::Exact) sync.prepare_for_backward({loss});
    loss.backward();
    expect_grads_match(m, ref, 1e-10, 1e-12, "no_sync");
  }
}

// The row reduction alone, on what ranks may hold: duplicate rows
// (uncoalesced), no gradient, a dense gradient, another index split, rows
// on no rank, and a gradient on no rank.
void expect_sparse_average_means_every_form(c10d::ProcessGroup& pg) {
  const int r = pg.getRank(), n = pg.getSize();
  const auto param = at::zeros({7, 3}, at::kDouble);
  auto local = [&](int k) -> at::Tensor {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(70 + k);
    auto rows = at::randn({4, 3}, gen, at::kDouble);
    switch (k % 4) {
      case 0:  // rows 1 and 5 twice
        return at::sparse_coo_tensor(at::tensor({1, 5, 1, 5}, at::kLong).view({1, 4}), rows,
                                     {7, 3});
      case 1:
        return at::Tensor();
      case 2:  // dense, rows 0 and 6 zero
        return at::cat({at::zeros({1, 3}, at::kDouble), rows, at::randn({1, 3}, gen, at::kDouble),
                        at::zeros({1, 3}, at::kDouble)});
      default:  // both dimensions as indices
        return at::randn({7, 3}, gen, at::kDouble).to_sparse(2);
    }
  };
  for (int shift = 0; shift < 4; ++shift) {  // rank k holds form k + shift: all forms meet
    auto want = at::zeros({7, 3}, at::kDouble);
    for (int k = 0; k < n; ++k) {
      if (local(k + shift).defined()) want += local(k + shift).to_dense();
    }
    auto got = ddpx::hooks::sparse_average(pg, local(r + shift), param, 1);
    ASSERT_TRUE(got.avg.defined());
    EXPECT_TRUE(got.avg.is_sparse() && got.avg.is_coalesced() && got.avg.sparse_dim() == 1);
    EXPECT_TRUE(at::allclose(got.avg.to_dense(), want / n, 1e-12, 1e-14)) << "shift " << shift;
  }
  // Used, but no rows anywhere: an average with none.
  auto none =
      at::sparse_coo_tensor(at::zeros({1, 0}, at::kLong), at::zeros({0, 3}, at::kDouble), {7, 3});
  auto got = ddpx::hooks::sparse_average(pg, none, param, 1);
  ASSERT_TRUE(got.avg.defined());
  EXPECT_EQ(got.avg._nnz(), 0);
  // No gradient anywhere: none back (.grad stays untouched).
  got = ddpx::hooks::sparse_average(pg, at::Tensor(), param, 1);
  EXPECT_FALSE(got.avg.defined());
  EXPECT_EQ(got.wire_bytes, 8);
}

TEST(SparseAverage, MeansWhatEveryRankHoldsWhateverItsForm) {
  SCOPED_TRACE("ddpx_mpi");
  expect_sparse_average_means_every_form(*world());
  SCOPED_TRACE("gloo");
  expect_sparse_average_means_every_form(*ddpx::comm::make("gloo"));
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
