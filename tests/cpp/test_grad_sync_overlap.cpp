// GradSync across the step boundary (GradSyncOptions::overlap), mpirun with
// 2 and 3 ranks, on torch::nn models: the optimizer stepped bucket by
// bucket (Overlap::Optimizer) and the next forward gated per parameter
// (Overlap::NextForward) must leave the parameters bit for bit where the
// synchronous path leaves them (GradSync with Overlap::None, then LibTorch's
// optimizer.step() after backward), for SGD with momentum and AdamW/Adam,
// over many steps, with a learning-rate schedule, param groups, unused
// parameters, no_sync accumulation, a lossy codec and a checkpoint resumed
// in the middle; and the misuses fail with errors that name them.
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "grad_sync_train_harness.h"
#include "sanitizer.h"

namespace {

using namespace ddpx_overlap_test;

class GradSyncOverlap : public ::testing::TestWithParam<Case> {};

TEST_P(GradSyncOverlap, BitwiseEqualToOptimizerAfterBackward) {
  expect_same_as_synchronous(GetParam().run, GetParam().name);
}

constexpr Unused kPredict = Unused::Predict;
const Case kCases[] = {
    {"OptimizerSgdNesterov", with(Overlap::Optimizer, Opt::SgdNesterov)},
    {"OptimizerAdamW", with(Overlap::Optimizer, Opt::AdamW)},
    {"NextForwardSgdNesterov", with(Overlap::NextForward, Opt::SgdNesterov)},
    {"NextForwardAdamW", with(Overlap::NextForward, Opt::AdamW)},
    {"NextForwardAdamExact", with(Overlap::NextForward, Opt::Adam, Unused::Exact)},
    {"NextForwardNoSync", with(Overlap::NextForward, Opt::SgdNesterov, kPredict, 2)},
    {"NextForwardCodecFp16", with(Overlap::NextForward, Opt::AdamW, kPredict, 1, "fp16")},
    {"OptimizerCodecTopk", with(Overlap::Optimizer, Opt::SgdNesterov, kPredict, 1, "topk:0.3")},
    {"NextForwardResumed", with(Overlap::NextForward, Opt::AdamW, kPredict, 1, "none", 85)},
    {"OptimizerResumedSgd", with(Overlap::Optimizer, Opt::SgdNesterov, kPredict, 1, "none", 131)},
};

INSTANTIATE_TEST_SUITE_P(Modes, GradSyncOverlap, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- misuse ------------------------------------------------------------------

using ddpx::test::error_of;

TEST(GradSyncOverlapErrors, OverlapWithoutOptimizerFailsAtBackward) {
  auto& pg = world();
  torch::manual_seed(3);
  Gated m;
  GradSync sync(m->named_parameters(), pg, GradSyncOptions().overlap(Overlap::Optimizer));
  auto x = shard(global_batch(6, 5), pg->getRank());
  const auto e = error_of([&] { m->forward(x, 0).backward(); });
  EXPECT_NE(e.find("set_optimizer"), std::string::npos) << e;
}

TEST(GradSyncOverlapErrors, SetOptimizerIsCheckedLocally) {
  auto& pg = world();
  torch::manual_seed(3);
  Gated m, other;
  {
    GradSync sync(m->named_parameters(), pg);
    torch::optim::SGD sgd(m->parameters(), torch::optim::SGDOptions(0.1));
    EXPECT_NE(error_of([&] { sync.set_optimizer(sgd); }).find("Overlap::None"), std::string::npos);
  }
  GradSync sync(m->named_parameters(), pg, GradSyncOptions().overlap(Overlap::Optimizer));
  torch::optim::RMSprop rms(m->parameters(), torch::optim::RMSpropOptions(0.1));
  EXPECT_NE(error_of([&] { sync.set_optimizer(rms); }).find("SGD, Adam or AdamW"), std::string::npos);
  torch::optim::SGD foreign(other->parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_NE(error_of([&] { sync.set_optimizer(foreign); }).find("not a parameter GradSync"),
            std::string::npos);
}

TEST(GradSyncOverlapErrors, UngatedForwardFailsTheNextBackwardOnEveryRank) {
  // The misuse it checks is a race by construction (a forward and the next
  // backward's gradient accumulation run against the last step's update in
  // flight); GradSync names it afterwards. ThreadSanitizer rightly reports it.
  if (ddpx::test::kThreadSanitizer) GTEST_SKIP() << "races on purpose";
  auto& pg = world();
  torch::manual_seed(3);
  Gated m;
  torch::optim::SGD sgd(m->parameters(), torch::optim::SGDOptions(0.1));
  GradSync sync(m->named_parameters(), pg, GradSyncOptions().overlap(Overlap::NextForward));
  sync.set_optimizer(sgd);
  auto x = shard(global_batch(6, 5), pg->getRank());
  m->forward(x, 0).backward();  // no gate needed: nothing was in flight yet
  const auto e = error_of([&] { m->forward(x, 1).backward(); });  // read without its gate
  EXPECT_NE(e.find("without waiting for its update"), std::string::npos) << e;
  // Gated again, the next steps run (the failed step sent nothing).
  sync.synchronize();
  m->gate = [&sync](const std::vector<at::Tensor>& ps) { sync.wait_ready(ps); };
  m->forward(x, 2).backward();
  m->forward(x, 3).backward();
  sync.synchronize();
}

// After backward returns under NextForward, the update is on its way: the
// gate of every parameter opens, and a synchronize() sees the new values.
TEST(GradSyncOverlapGates, BackwardReturnsBeforeTheUpdateAndTheGateWaitsForIt) {
  auto& pg = world();
  torch::manual_seed(3);
  Gated m;
  torch::optim::SGD sgd(m->parameters(), torch::optim::SGDOptions(0.1));
  GradSync sync(m->named_parameters(), pg, GradSyncOptions().overlap(Overlap::NextForward));
  sync.set_optimizer(sgd);
  m->gate = [&sync](const std::vector<at::Tensor>& ps) { sync.wait_ready(ps); };
  const auto before = m->head->weight.detach().clone();
  auto x = shard(global_batch(6, 5), pg->getRank());
  m->forward(x, 0).backward();
  sync.wait_ready({m->head->weight});
  EXPECT_FALSE(at::equal(before, m->head->weight)) << "the gate opened before the update";
  sync.synchronize();
  const auto& st = sync.last_step();
  EXPECT_EQ(st.step, 1);
  EXPECT_GT(st.bytes_reduced, 0);
}

}  // namespace

namespace {

// Priority (GradSyncOptions::priority): on a communication-bound model the
// buckets that would wait for the link past the end of backward are held
// and launch at its end first layer first, so the first layer's bucket,
// though it filled last, completes before the held ones that filled
// earlier (seen in the step records); and the parameters stay bitwise
// those of the synchronous path.
// head > 0: a last layer of that many outputs, one large parameter whose
// gradient comes first in backward and is still on the wire when it ends:
// backward pauses after the head (SlowBackward) for half of the head's
// all-reduce as measured on this machine now, so that holds under any load
// (the link neither done with the head by the end of backward nor not begun).
struct WideImpl : torch::nn::Module {
  std::vector<torch::nn::Linear> layers;
  torch::nn::Linear head{nullptr};
  std::function<void(const std::vector<at::Tensor>&)> gate;
  explicit WideImpl(int64_t head_outputs = 0) {
    for (int i = 0; i < 6; ++i) {
      layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(384, 384)));
    }
    if (head_outputs > 0) {
      head = register_module("head", torch::nn::Linear(384, head_outputs));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = x;
    for (auto& l : layers) {
      if (gate) gate(l->parameters());
      h = torch::tanh(l(h));
    }
    if (head) {
      if (gate) gate(head->parameters());
      h = head(SlowBackward::apply(h));
    }
    return h.pow(2).mean();
  }
};
TORCH_MODULE(Wide);

std::pair<std::vector<at::Tensor>, std::vector<ddpx::StepStats>> train_wide(
    Overlap overlap, int steps, const std::string& trace = "", int64_t head = 0) {
  auto& pg = world();
  torch::manual_seed(11);
  Wide m(head);
  torch::optim::SGD sgd(m->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  GradSync sync(m->named_parameters(), pg,
                GradSyncOptions().overlap(overlap).bucket_cap_mb(0.3).first_bucket_mb(0.3).trace(
                    trace).trace_steps("10:30"));
  if (overlap != Overlap::None) {
    sync.set_optimizer(sgd);
    m->gate = [&sync](const std::vector<at::Tensor>& ps) { sync.wait_ready(ps); };
  }
  std::vector<ddpx::StepStats> records;
  for (int step = 0; step < steps; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(40 + step);
    auto x = at::randn({pg->getSize() * 2, 384}, gen).narrow(0, pg->getRank() * 2, 2);
    if (overlap == Overlap::None) sgd.zero_grad();
    m->forward(x).backward();
    if (overlap == Overlap::None) sgd.step();
    // (last_step() joins the step under NextForward: on odd steps only, so
    // the other forwards overlap the updates and wait at gates.)
    if (step % 2 == 1) records.push_back(sync.last_step());
  }
  sync.synchronize();
  sync.flush_trace();
  std::vector<at::Tensor> out;
  for (const auto& p : m->parameters()) out.push_back(p.detach().clone());
  return {out, records};
}

TEST(GradSyncOverlapPriority, HeldBucketsGoFirstLayerFirstAndChangeNothing) {
  const auto [want, unused_records] = train_wide(Overlap::None, 30);
  const std::string trace = ::testing::TempDir() + "ddpx_priority_trace.json";
  const auto [got, records] = train_wide(Overlap::NextForward, 30, trace);
  expect_bitwise(got, want, "priority");
  // The trace shows where the next forward waited, per parameter (the first
  // layer's read comes right after backward returns, its update on the wire).
  if (world()->getRank() == 0) {
    std::ifstream f(trace);
    std::stringstream text;
    text << f.rdbuf();
    EXPECT_NE(text.str().find("\"ddpx::gate_wait l0.weight\""), std::string::npos)
        << "no gate wait of the first layer in the trace " << trace;
  }
  int prioritised = 0;
  for (const auto& st : records) {
    std::vector<const ddpx::StepStats::Bucket*> held;
    for (const auto& b : st.buckets) {
      if (b.held) held.push_back(&b);
    }
    if (held.size() < 2) continue;
    ++prioritised;
    // Launched in reverse plan order, and on one channel completed so (a
    // priority launch goes one bucket at a time, calls_in_flight
    // notwithstanding): the last bucket of the plan (the first layer) first.
    for (size_t i = 1; i < held.size(); ++i) {
      EXPECT_LE(held[i]->launch_us, held[i - 1]->launch_us) << "step " << st.step;
      EXPECT_LE(held[i]->complete_us, held[i - 1]->complete_us) << "step " << st.step;
    }
    // Every held bucket filled before the last one was launched.
    EXPECT_LE(held.front()->ready_us, held.back()->launch_us) << "step " << st.step;
  }
  EXPECT_GT(prioritised, 0) << "no step held buckets: the model was not communication-bound "
                               "here, or the priority tail was never planned";
  // The measured switch's trial (priority_trial.h): steps that the plan
  // holds buckets in but that ran first in, first out, in plan order.
  int fifo = 0;
  for (const auto& st : records) {
    if (st.held_planned < 2 || st.priority_on) continue;
    ++fifo;
    for (size_t b = 0; b < st.buckets.size(); ++b) {
      EXPECT_FALSE(st.buckets[b].held) << "step " << st.step;
      if (b > 0) EXPECT_GE(st.buckets[b].launch_us, st.buckets[b - 1].launch_us) << "step " << st.step;
    }
  }
  EXPECT_GT(fifo, 0) << "no first-in-first-out trial step while the plan held buckets";
}

// A large parameter (the head's weight, a bucket of its own) goes on the
// wire first in backward and is still being sent when backward ends; the
// plan cuts it (BucketPlan::held_from), and the held buckets, launched
// later but needed first by the next forward, complete before its
// remainder -- the step records show it. Parameters stay bitwise.
TEST(GradSyncOverlapPriority, HeldBucketsOvertakeTheRemainderOfALargeParameter) {
  constexpr int64_t kHead = 8192;  // 384 x 8192 floats: 12 MiB
  backward_pause() = std::chrono::milliseconds(
      std::max<int64_t>(2, slowest_allreduce_ms(at::empty({kHead, 384})) / 2));
  const auto [want, unused_records] = train_wide(Overlap::None, 30, "", kHead);
  const auto [got, records] = train_wide(Overlap::NextForward, 30, "", kHead);
  expect_bitwise(got, want, "priority, cut");
  int cut_steps = 0;
  for (const auto& st : records) {
    const ddpx::StepStats::Bucket* cut = nullptr;
    for (const auto& b : st.buckets) {
      if (b.held_bytes > 0) cut = &b;
    }
    if (cut == nullptr) continue;
    ++cut_steps;
    EXPECT_TRUE(st.priority_on) << "step " << st.step << ": cut without priority";
    EXPECT_LT(cut->held_bytes, cut->bytes) << "step " << st.step;
    for (const auto& b : st.buckets) {
      if (!b.held) continue;
      EXPECT_GE(b.launch_us, cut->launch_us) << "step " << st.step;
      EXPECT_LE(b.complete_us, cut->complete_us)
          << "step " << st.step << ": held bucket " << b.index
          << " completed after the remainder it should overtake";
    }
  }
  EXPECT_GT(cut_steps, 0) << "no step cut the head's bucket: it was not on the wire at the end "
                             "of backward here, or the cut was never planned";
}

}  // namespace
