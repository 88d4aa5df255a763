#pragma once
// Models and helpers shared by the GradSync test files (test_grad_sync*.cpp,
// one binary under mpirun with 2 and 3 ranks). The reference for every model
// is one process computing the gradient of the whole batch (all ranks'
// shards): N ranks x batch B must give the gradients of 1 process x batch N*B.
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "mpi_test_util.h"

namespace ddpx::test::grad_sync {

using ddpx::Unused;

inline ddpx::comm::ProcessGroupPtr& world() { return ddpx::test::world_pg(); }

constexpr int kB = 4;  // per-rank batch

// How long SlowBackward's backward takes (tests set it from
// slowest_allreduce_ms, so a pause and a reduction keep their proportion on a
// loaded machine: 3 ranks under ASan on 2 cores are many times slower).
inline std::chrono::milliseconds& backward_pause() {
  static std::chrono::milliseconds pause{40};
  return pause;
}

// Identity whose backward takes backward_pause(): a slow layer between two others.
struct SlowBackward : torch::autograd::Function<SlowBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    std::this_thread::sleep_for(backward_pause());
    return g;
  }
};

// One all-reduce of a tensor like `like` as measured here now (after a
// warm-up): the slowest rank's, in ms, alike on every rank.
inline int64_t slowest_allreduce_ms(const at::Tensor& like) {
  auto& pg = world();
  std::vector<at::Tensor> t{at::ones_like(like)};
  pg->allreduce(t)->wait();  // warm-up
  const auto t0 = std::chrono::steady_clock::now();
  pg->allreduce(t)->wait();
  const auto took =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  std::vector<at::Tensor> ms{at::full({1}, static_cast<int64_t>(took.count()), at::kLong)};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  pg->allreduce(ms, o)->wait();
  return ms[0].item<int64_t>();
}

// Shard of rank r: rows [r*B, (r+1)*B) of a batch every rank can regenerate.
inline at::Tensor global_batch(int64_t features, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn({world()->getSize() * kB, features}, gen, at::kDouble);
}
inline at::Tensor shard(const at::Tensor& g, int r) { return g.narrow(0, r * kB, kB); }

// Two experts behind a shared trunk: a on even steps, b on odd ones.
struct ExpertsImpl : torch::nn::Module {
  torch::nn::Linear trunk{nullptr}, a{nullptr}, b{nullptr}, head{nullptr};
  int step = 0;
  ExpertsImpl() {
    trunk = register_module("trunk", torch::nn::Linear(6, 6));
    a = register_module("a", torch::nn::Linear(6, 6));
    b = register_module("b", torch::nn::Linear(6, 6));
    head = register_module("head", torch::nn::Linear(6, 2));
    to(at::kDouble);
  }
  // Every rank picks the same expert: a on even steps, b on odd ones.
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(trunk(x));
    return head(torch::relu(step % 2 == 0 ? a(h) : b(h))).pow(2).mean();
  }
};
TORCH_MODULE(Experts);

// One process's gradients for the global batch g at ref's step: the shards'
// losses / n summed (equal shards: the mean over the batch), then backward.
// (`scale` multiplies the loss: 0 gives zero gradients, every hook firing.)
template <class Model>
void backward_global(Model& ref, const at::Tensor& g, int n, double scale = 1.0) {
  at::Tensor total;
  for (int k = 0; k < n; ++k) {
    auto l = ref(shard(g, k)) * (scale / n);
    total = total.defined() ? total + l : l;
  }
  total.backward();
}

// m's gradients against ref's: defined alike, of the same layout (sparse
// ones compared densely), and within atol + rtol |want|.
template <class Model>
void expect_grads_match(Model& m, Model& ref, double rtol, double atol, const std::string& where) {
  auto rp = ref->named_parameters();
  for (const auto& item : m->named_parameters()) {
    const auto& want = rp[item.key()].grad();
    const auto& got = item.value().grad();
    ASSERT_EQ(got.defined(), want.defined()) << item.key() << " " << where;
    if (!want.defined()) continue;
    EXPECT_EQ(got.is_sparse(), want.is_sparse()) << item.key() << " " << where;
    const at::Tensor g = got.to_dense(), w = want.to_dense();
    EXPECT_TRUE(at::allclose(g, w, rtol, atol))
        << item.key() << " " << where << ": max diff " << (g - w).abs().max().item<double>();
  }
}

// The modes the Experts tests run: (unused mode, zero_grad in place). In
// place, .grad is the bucket slot, and an idle expert's must keep its value.
inline const std::vector<std::pair<Unused, bool>> kExpertModes{
    {Unused::Predict, false}, {Unused::Exact, false}, {Unused::Predict, true}};

inline std::string mode_name(Unused u, bool in_place) {
  return std::string(u == Unused::Predict ? "Predict" : "Exact") +
         (in_place ? ", zero_grad in place" : "");
}

// Two models with the same initial weights: the one-process reference and
// the one under GradSync.
inline std::pair<Experts, Experts> twin_experts(uint64_t seed) {
  torch::manual_seed(seed);
  Experts ref;
  torch::manual_seed(seed);
  Experts m;
  return {ref, m};
}

// Two towers whose execution order flips at step kFlip: backward order changes.
struct FlipImpl : torch::nn::Module {
  std::vector<torch::nn::Linear> tower;
  int step = 0;
  static constexpr int kFlip = 3;
  FlipImpl() {
    for (int i = 0; i < 6; ++i) {
      tower.push_back(register_module("t" + std::to_string(i), torch::nn::Linear(16, 16)));
    }
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = x;
    for (int i = 0; i < 6; ++i) h = torch::tanh(tower[step < kFlip ? i : 5 - i](h));
    return h.pow(2).mean();
  }
};
TORCH_MODULE(Flip);

// loss_of(model, x, rank) -> scalar loss for a shard. The reference averages
// the per-shard losses (equal shard sizes: the mean over the whole batch).
template <typename M>
using LossFn = std::function<at::Tensor(M&, const at::Tensor&, int)>;

// zero_in_place: zero_grad(set_to_none=false) between steps, so that .grad
// stays the bucket view and backward accumulates into the bucket.
template <typename M>
inline void expect_matches_reference(std::function<M()> make, LossFn<M> loss_of, int64_t features,
                              ddpx::GradSyncOptions opts = {}, int steps = 3, bool zero_in_place = false) {
  auto& pg = world();
  const int r = pg->getRank(), n = pg->getSize();
  torch::manual_seed(1234);
  M ref = make();
  torch::manual_seed(1234 + 0);  // same init on every rank, GradSync broadcasts anyway
  M model = make();
  ddpx::GradSync sync((*model).named_parameters(), pg, opts, (*model).named_buffers());
  for (int step = 0; step < steps; ++step) {
    auto g = global_batch(features, 100 + step);
    (*ref).zero_grad(/*set_to_none=*/!zero_in_place);
    at::Tensor total;
    for (int k = 0; k < n; ++k) {
      auto l = loss_of(ref, shard(g, k), k) / n;
      total = total.defined() ? total + l : l;
    }
    total.backward();
    (*model).zero_grad(/*set_to_none=*/!zero_in_place);
    auto loss = loss_of(model, shard(g, r), r);
    if (opts.unused_ == Unused::Exact) sync.prepare_for_backward({loss});
    loss.backward();
    auto rp = (*ref).named_parameters();
    for (const auto& item : (*model).named_parameters()) {
      const auto& want = rp[item.key()].grad();
      const auto& got = item.value().grad();
      ASSERT_EQ(want.defined(), got.defined()) << item.key() << " step " << step;
      if (want.defined()) {
        EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-8)) << item.key() << " step " << step;
      }
    }
  }
}

}  // namespace ddpx::test::grad_sync
