// GradSync's Overlap::NextForward on a scripted model, mpirun with 2 and 3
// ranks: the graph pass puts ddpx::param_ready before every read of a
// parameter or buffer in every method (shared submodule graphs, a tied
// weight, BatchNorm's buffers, a branch, an exported method), once; and the
// gated model trains bit for bit like the synchronous path (GradSync with
// Overlap::None, then LibTorch's optimizer after backward), an exported
// method called between steps seeing the updated parameters. The model is
// scripted at test time by export_gated_model.py (DDPX_GATED_MODEL).
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <unordered_set>

#include "hooks/param_gate.h"
#include "mpi_test_util.h"

namespace {

using ddpx::GradSync;
using ddpx::GradSyncOptions;
using ddpx::Overlap;

constexpr int64_t kB = 4;  // per-rank batch

ddpx::comm::ProcessGroupPtr& world() { return ddpx::test::world_pg(); }

torch::jit::Module load_model() {
  const char* path = std::getenv("DDPX_GATED_MODEL");
  if (path == nullptr) throw std::runtime_error("DDPX_GATED_MODEL is not set (run via ctest)");
  torch::jit::Module m = torch::jit::load(path);
  m.train();
  return m;
}

struct Reads {
  int gated = 0, ungated = 0, gates = 0;
};

void count_reads(torch::jit::Block* block, Reads* r) {
  static const auto kGate = c10::Symbol::fromQualString("ddpx::param_ready");
  static const auto kOptionalGate = c10::Symbol::fromQualString("ddpx::param_ready_optional");
  auto is_gate = [](const torch::jit::Node* n) {
    return n->kind() == kGate || n->kind() == kOptionalGate;
  };
  for (torch::jit::Node* n : block->nodes()) {
    for (auto* b : n->blocks()) count_reads(b, r);
    if (is_gate(n)) ++r->gates;
    if (n->kind() != c10::prim::GetAttr) continue;
    const auto cls = n->input(0)->type()->cast<c10::ClassType>();
    if (!cls) continue;
    const auto slot = cls->findAttributeSlot(n->s(c10::attr::name));
    if (!slot || !(cls->is_parameter(*slot) || cls->is_buffer(*slot))) continue;
    bool gated = true;
    for (const auto& u : n->output()->uses()) gated = gated && is_gate(u.user);
    ++(gated ? r->gated : r->ungated);
  }
}

// Every method graph of every module type in m, each once.
Reads reads_of(const torch::jit::Module& m) {
  Reads r;
  std::unordered_set<const torch::jit::Graph*> seen;
  for (const auto& sub : m.modules()) {
    for (const auto& method : sub.get_methods()) {
      auto g = method.graph();
      if (seen.insert(g.get()).second) count_reads(g->block(), &r);
    }
  }
  return r;
}

TEST(GradSyncGated, GraphPassGatesEveryReadOnce) {
  torch::jit::Module m = load_model();
  const Reads before = reads_of(m);
  // fc.weight, fc.bias, gain x2 (Block); emb.weight x2, bn's 5 (Net), the
  // conv's weight and Optional bias, and weight_norm's two reads of a
  // submodule chain's parameters.
  ASSERT_GT(before.ungated, 8);
  EXPECT_EQ(before.gates, 0);
  {
    GradSync sync(m, world(), GradSyncOptions().overlap(Overlap::NextForward));
    const Reads after = reads_of(m);
    EXPECT_EQ(after.ungated, 0);
    EXPECT_EQ(after.gated, before.ungated);
    EXPECT_EQ(after.gates, before.ungated);
  }
  // A second GradSync over the same module adds no second gate.
  GradSync again(m, world(), GradSyncOptions().overlap(Overlap::NextForward));
  EXPECT_EQ(reads_of(m).gates, before.ungated);
  // The op alone (no update pending) is the identity.
  const at::Tensor w = m.attr("emb").toModule().attr("weight").toTensor();
  const at::Tensor out = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ddpx::param_ready", "")
                             .typed<at::Tensor(const at::Tensor&)>()
                             .call(w);
  EXPECT_TRUE(out.is_same(w));
}

// The op blocks while its tensor's gate is closed and returns it once the
// gate opens; a failed step opens the gate and the op rethrows the failure.
TEST(GradSyncGated, ParamReadyWaitsForItsGate) {
  using namespace std::chrono_literals;
  const at::Tensor a = at::ones({3}), b = at::zeros({2});
  auto gates = ddpx::hooks::Gates::make({a, b}, {"a", "b"});
  std::vector<int> waited;  // the tensors whose reads blocked (on_wait)
  gates->on_wait([&waited](int i, auto t0, auto t1) {
    EXPECT_LT(t0, t1);
    waited.push_back(i);
  });
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("ddpx::param_ready", "")
                .typed<at::Tensor(const at::Tensor&)>();
  gates->close_all();
  EXPECT_FALSE(gates->passed(0));
  auto read_a = std::async(std::launch::async, [&] { return op.call(a); });
  EXPECT_EQ(read_a.wait_for(100ms), std::future_status::timeout) << "read before the update";
  gates->open(1);  // another tensor's gate: a still waits
  EXPECT_EQ(read_a.wait_for(50ms), std::future_status::timeout);
  EXPECT_TRUE(op.call(b).is_same(b));
  gates->open(0);
  ASSERT_EQ(read_a.wait_for(10s), std::future_status::ready);
  EXPECT_TRUE(read_a.get().is_same(a));
  EXPECT_TRUE(gates->passed(0));
  const auto [us, waits] = gates->take_waits();
  EXPECT_EQ(waits, 1);
  EXPECT_EQ(waited, std::vector<int>{0});  // b's read did not block
  EXPECT_GT(us, 50e3);
  gates->close_all();
  auto failing = std::async(std::launch::async, [&] { return op.call(a); });
  gates->fail(std::make_exception_ptr(std::runtime_error("step 7 failed")));
  EXPECT_THROW(failing.get(), std::runtime_error);
  gates->reset();
  EXPECT_TRUE(op.call(a).is_same(a));
  // A tensor gated by a live Gates cannot be gated again.
  EXPECT_THROW(ddpx::hooks::Gates::make({a}, {"a"}), c10::Error);
}

at::Tensor tokens(int64_t step, int rank, int world_size) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return at::randint(0, 10, {world_size * kB, 5}, gen, at::kLong).narrow(0, rank * kB, kB);
}

enum class Opt { Sgd, AdamW };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const torch::jit::Module& m, Opt o) {
  std::vector<at::Tensor> ps;
  for (const auto& p : m.parameters()) ps.push_back(p);
  if (o == Opt::Sgd) {
    return std::make_unique<torch::optim::SGD>(
        ps, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3));
  }
  return std::make_unique<torch::optim::AdamW>(ps, torch::optim::AdamWOptions(0.01));
}

struct Trained {
  std::vector<at::Tensor> state;  // parameters, then buffers
  std::vector<double> norms;      // weight_norm() after each step
};

Trained train(Overlap overlap, Opt o, int steps) {
  auto& pg = world();
  torch::jit::Module m = load_model();
  auto opt = make_optimizer(m, o);
  GradSync sync(m, pg, GradSyncOptions().overlap(overlap).bucket_cap_mb(0.0005).first_bucket_mb(0.0002));
  if (overlap != Overlap::None) sync.set_optimizer(*opt);
  Trained t;
  for (int step = 0; step < steps; ++step) {
    if (overlap == Overlap::None) opt->zero_grad();
    m.forward({tokens(step, pg->getRank(), pg->getSize())}).toTensor().backward();
    if (overlap == Overlap::None) opt->step();
    // Between steps, with updates possibly still on the wire: the method's
    // reads are gated too.
    t.norms.push_back(m.run_method("weight_norm").toTensor().item<double>());
  }
  sync.synchronize();
  for (const auto& p : m.parameters()) t.state.push_back(p.detach().clone());
  for (const auto& b : m.buffers()) t.state.push_back(b.detach().clone());
  return t;
}

class GradSyncGatedTraining : public ::testing::TestWithParam<Opt> {};

TEST_P(GradSyncGatedTraining, BitwiseLikeTheSynchronousPath) {
  const Trained want = train(Overlap::None, GetParam(), 200);
  const Trained got = train(Overlap::NextForward, GetParam(), 200);
  ASSERT_EQ(got.state.size(), want.state.size());
  for (size_t i = 0; i < got.state.size(); ++i) {
    EXPECT_TRUE(at::equal(got.state[i], want.state[i]))
        << "tensor " << i << " differs by up to "
        << (got.state[i] - want.state[i]).abs().max().item<double>();
  }
  ASSERT_EQ(got.norms.size(), want.norms.size());
  for (size_t s = 0; s < got.norms.size(); ++s) {
    ASSERT_EQ(got.norms[s], want.norms[s]) << "weight_norm() after step " << s;
  }
  EXPECT_NE(want.norms.front(), want.norms.back()) << "the model did not train";
}

INSTANTIATE_TEST_SUITE_P(Optimizers, GradSyncGatedTraining, ::testing::Values(Opt::Sgd, Opt::AdamW),
                         [](const auto& info) {
                           return std::string(info.param == Opt::Sgd ? "SgdMomentum" : "AdamW");
                         });

}  // namespace
