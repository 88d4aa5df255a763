// Issue 47: a lossy codec's results do not depend on the bucket plan. The
// same training with int8, top-k, PowerSGD, fp16 and bf16, under plans forced
// to differ -- one bucket, many small ones, timed plans (the default) with a
// busy thread stretching backward's pauses, re-plans mid-run -- ends with the
// same parameters bit for bit. What a parameter's gradient becomes on the
// wire depends on that parameter and its residual only: int8 chunks start at
// each tensor's first element, top-k's budget is per tensor, PowerSGD works
// per matrix and keeps each one's warm start under the parameter's own part
// key, fp16 and bf16 add in rank order, and a re-plan hands each parameter's
// residual on to its new bucket.
#include <torch/optim/sgd.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "grad_sync_test_models.h"

namespace {

using ddpx::GradSync;
using ddpx::GradSyncOptions;
using namespace ddpx::test::grad_sync;

// Tensors of odd sizes, so that a bucket-wide chunking would straddle them.
struct OddImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  OddImpl() {
    a = register_module("a", torch::nn::Linear(23, 37));
    b = register_module("b", torch::nn::Linear(37, 29));
    c = register_module("c", torch::nn::Linear(29, 5));
  }
  at::Tensor forward(const at::Tensor& x) {
    return (c(torch::tanh(b(torch::tanh(a(x))))) - x.narrow(1, 0, 5)).pow(2).mean();
  }
};
TORCH_MODULE(Odd);

struct Plan {
  std::string name;
  GradSyncOptions options;
  bool busy = false;  // a spinning thread on every rank while training
  int reload_at = -1;  // load_state(state()) after this step: a re-plan mid-run
};

// The optimizer of every run here: SGD with momentum.
torch::optim::SGD sgd_of(Odd& m) {
  return torch::optim::SGD(m->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
}

// Steps [from, to) of SGD on this rank's shards of the batches seed + step.
void sgd_steps(Odd& m, torch::optim::SGD& opt, int64_t seed, int from, int to,
               const std::function<void(int)>& after = nullptr) {
  for (int step = from; step < to; ++step) {
    const auto g = global_batch(23, seed + step).to(at::kFloat);
    opt.zero_grad();
    m(shard(g, world()->getRank())).backward();
    opt.step();
    if (after) after(step);
  }
}

// The parameters after `steps` steps of SGD with momentum, and the number of
// buckets of the last plan.
std::vector<at::Tensor> train(const std::string& codec, const Plan& plan, int steps,
                              size_t* buckets) {
  auto& pg = world();
  torch::manual_seed(21);
  Odd m;
  GradSync sync(m->named_parameters(), pg, GradSyncOptions(plan.options).codec(codec));
  torch::optim::SGD opt = sgd_of(m);
  std::atomic<bool> stop{false};
  std::thread spin;
  if (plan.busy) {
    spin = std::thread([&] {
      volatile double x = 0;
      while (!stop.load(std::memory_order_relaxed)) x = x + 1;
    });
  }
  sgd_steps(m, opt, 4000, 0, steps, [&](int step) {
    // A re-plan (by size, new keys): each codec residual goes back to its
    // parameters and rides with their next gradients.
    if (step == plan.reload_at) sync.load_state(sync.state());
  });
  stop = true;
  if (spin.joinable()) spin.join();
  *buckets = sync.bucket_plan().size();
  std::vector<at::Tensor> out;
  for (const auto& p : m->parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST(GradSync, LossyCodecsRepeatWhateverThePlan) {
  const std::vector<Plan> plans{
      {"one bucket", GradSyncOptions().bucket_cap_mb(25).first_bucket_mb(25).replan(false)},
      {"small buckets", GradSyncOptions().bucket_cap_mb(0.003).first_bucket_mb(0.001).replan(false)},
      {"timed plans, busy, re-plan", GradSyncOptions().bucket_cap_mb(0.004).first_bucket_mb(0.002),
       true, 4},
      {"untimed plans, re-plan", GradSyncOptions().bucket_cap_mb(0.002).timed_plans(false), false,
       7},
      {"no priority, busy", GradSyncOptions().bucket_cap_mb(0.004).priority(false), true},
  };
  for (const std::string codec : {"int8", "int8:7", "topk:0.1", "powersgd:2", "fp16", "bf16"}) {
    SCOPED_TRACE(codec);
    std::vector<at::Tensor> first;
    std::vector<size_t> buckets;
    for (const auto& plan : plans) {
      SCOPED_TRACE(plan.name);
      buckets.push_back(0);
      const auto got = train(codec, plan, 12, &buckets.back());
      if (first.empty()) {
        first = got;
        continue;
      }
      ASSERT_EQ(got.size(), first.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(at::equal(got[i], first[i]))
            << "parameter " << i << " differs by up to "
            << (got[i] - first[i]).abs().max().item<double>();
      }
    }
    // The plans really differed: one bucket against several.
    EXPECT_EQ(buckets[0], 1u);
    EXPECT_GE(buckets[1], 3u);
  }
}

// A checkpoint's GradSync::State carries each rank's residuals: a run
// stopped after step 6 (state(), the parameters and the momentum kept), then
// continued by a new model, optimizer and GradSync that load them, ends where
// the straight run does, bit for bit -- with every codec that keeps error
// feedback, across a plan that differs before and after the stop. Without
// the residuals (an empty vector) int8 would not, nor PowerSGD without its
// warm starts (the test's own controls).
TEST(GradSync, StateCarriesTheResidualsAcrossAResume) {
  auto& pg = world();
  constexpr int kSteps = 12, kStop = 6, kSeed = 5000;
  for (const std::string codec : {"int8", "topk:0.1", "fp16", "bf16", "powersgd:2"}) {
    SCOPED_TRACE(codec);
    const auto opts = [&] { return GradSyncOptions().codec(codec).bucket_cap_mb(0.003); };
    torch::manual_seed(8);
    Odd straight;
    std::vector<at::Tensor> want;
    {
      GradSync sync(straight->named_parameters(), pg, opts());
      torch::optim::SGD opt = sgd_of(straight);
      sgd_steps(straight, opt, kSeed, 0, kSteps);
      for (const auto& p : straight->parameters()) want.push_back(p.detach().clone());
    }
    // With everything; without the residuals; without the warm starts.
    for (int drop : {0, 1, 2}) {
      SCOPED_TRACE(drop == 0 ? "whole state" : drop == 1 ? "no residuals" : "no warm starts");
      torch::manual_seed(8);
      Odd first;
      GradSync::State st;
      std::vector<at::Tensor> momentum;
      {
        GradSync sync(first->named_parameters(), pg, opts());
        torch::optim::SGD opt = sgd_of(first);
        sgd_steps(first, opt, kSeed, 0, kStop);
        st = sync.state();
        for (const auto& p : first->parameters()) {
          const auto& s = static_cast<const torch::optim::SGDParamState&>(
              *opt.state().at(p.unsafeGetTensorImpl()));
          momentum.push_back(s.momentum_buffer().clone());
        }
      }
      ASSERT_EQ(st.residuals.size(), first->parameters().size());
      const bool powersgd = codec.rfind("powersgd", 0) == 0;
      // PowerSGD's warm starts: one per matrix (the weights), none elsewhere.
      ASSERT_EQ(st.warm_starts.size(), first->parameters().size());
      for (size_t i = 0; i < st.warm_starts.size(); ++i) {
        EXPECT_EQ(st.warm_starts[i].defined(), powersgd && first->parameters()[i].dim() == 2) << i;
      }
      if (drop == 1) st.residuals.clear();
      if (drop == 2) st.warm_starts.clear();
      torch::manual_seed(99);  // other initial values: all must come from the stop
      Odd second;
      {
        torch::NoGradGuard no_grad;
        auto fp = first->parameters(), sp = second->parameters();
        for (size_t i = 0; i < fp.size(); ++i) sp[i].copy_(fp[i]);
      }
      // Another plan after the resume (by size, load_state re-plans).
      GradSync sync(second->named_parameters(), pg, opts().bucket_cap_mb(0.001));
      sync.load_state(st);
      torch::optim::SGD opt = sgd_of(second);
      {
        // The momentum buffers, as a checkpoint's optimizer state restores them.
        opt.zero_grad();
        auto sp = second->parameters();
        for (size_t i = 0; i < sp.size(); ++i) {
          auto s = std::make_unique<torch::optim::SGDParamState>();
          s->momentum_buffer(momentum[i].clone());
          opt.state()[sp[i].unsafeGetTensorImpl()] = std::move(s);
        }
      }
      sgd_steps(second, opt, kSeed, kStop, kSteps);
      auto got = second->parameters();
      bool same = true;
      for (size_t i = 0; i < got.size(); ++i) same = same && at::equal(got[i], want[i]);
      if (drop == 0) {
        EXPECT_TRUE(same) << "the resumed run left the straight one";
      } else if ((codec == "int8" && drop == 1) || (powersgd && drop == 2)) {
        EXPECT_FALSE(same) << "dropping part of the state changed nothing: the test proves nothing";
      }
    }
  }
}

}  // namespace
