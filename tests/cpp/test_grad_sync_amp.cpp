// GradSync with mixed precision (ddpx/amp.h, GradSyncOptions::mixed_precision)
// under mpirun (2 and 3 ranks): an inf or NaN in one rank's gradient skips
// the step on every rank, with each codec, whether the trainer steps through
// the scaler or GradSync does (the same parameters, bit for bit); the
// scaler's own all-reduce where no reduction carries the inf; float32
// masters of bfloat16 parameters against a float32 run, in every overlap
// mode, where pure bfloat16 stalls, through a checkpoint; reduce_dtype; and
// the errors that name what is wrong.
#include <ddpx/amp.h>

#include <limits>
#include <sstream>

#include "grad_sync_test_models.h"

namespace {

using ddpx::GradScaler;
using ddpx::GradScalerOptions;
using ddpx::GradSync;
using ddpx::GradSyncOptions;
using ddpx::Overlap;
using ddpx::test::error_of;
using namespace ddpx::test::grad_sync;

// Matrices (PowerSGD compresses both weights) and biases.
struct NetImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  NetImpl() {
    a = register_module("a", torch::nn::Linear(12, 16));
    b = register_module("b", torch::nn::Linear(16, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return b(torch::tanh(a(x))); }
};
TORCH_MODULE(Net);

// This rank's loss at `step`. inject: its a.weight[2][3] gradient is +inf
// (the loss gains (a.weight * mask).sum(), mask inf there, zero elsewhere).
at::Tensor loss_at(Net& m, int step, at::ScalarType dtype, bool inject) {
  const int r = world()->getRank();
  const at::Tensor x = shard(global_batch(12, 900 + step), r).to(dtype);
  const at::Tensor y = shard(global_batch(4, 1900 + step), r).to(at::kFloat);
  at::Tensor loss = torch::mse_loss(m(x).to(at::kFloat), y);
  if (inject) {
    at::Tensor mask = torch::zeros_like(m->a->weight);
    mask[2][3] = std::numeric_limits<float>::infinity();
    loss = loss + (m->a->weight * mask).sum().to(at::kFloat);
  }
  return loss;
}

// Whether `t` (its bits) is the same on every rank.
bool same_everywhere(const at::Tensor& t) {
  const at::Tensor bits = t.detach().to(at::kFloat).contiguous().view(at::kInt).to(at::kLong);
  const int64_t h =
      (bits.reshape(-1) * at::arange(1, bits.numel() + 1, at::kLong)).sum().item<int64_t>();
  std::vector<at::Tensor> v{at::tensor({h, -h}, at::kLong)};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  world()->allreduce(v, o)->wait();
  return v[0][0].item<int64_t>() == -v[0][1].item<int64_t>();
}

std::vector<at::Tensor> snapshot(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone());
  return out;
}

bool equal_bits(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::equal(a[i], b[i])) return false;
  }
  return true;
}

constexpr int kInfStep = 2;
const std::vector<std::string> kCodecs{"none", "fp16", "bf16", "int8", "topk:0.5", "powersgd:2"};

// One run of the scaler over kSteps steps, the inf on the last rank at
// kInfStep. Overlap::None: the trainer calls scaler.step and update;
// otherwise GradSync steps (set_optimizer(opt, scaler)). Returns the final
// parameters; `stepped` gets whether each step stepped.
std::vector<at::Tensor> scaled_run(const std::string& codec, Overlap overlap,
                                   std::vector<bool>* stepped, std::vector<double>* scales) {
  constexpr int kSteps = 5;
  const int r = world()->getRank(), n = world()->getSize();
  torch::manual_seed(11);
  Net m;
  GradSync sync(m->named_parameters(), world(),
                GradSyncOptions().codec(codec).overlap(overlap).timed_plans(false));
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  GradScaler scaler(GradScalerOptions().init_scale(256).growth_interval(2));
  if (overlap != Overlap::None) sync.set_optimizer(opt, scaler);
  for (int step = 0; step < kSteps; ++step) {
    if (overlap == Overlap::None) opt.zero_grad();
    if (overlap == Overlap::NextForward) sync.wait_ready(m->parameters());
    const auto before = snapshot(m->parameters());
    scaler.scale(loss_at(m, step, at::kFloat, step == kInfStep && r == n - 1)).backward();
    bool did;
    if (overlap == Overlap::None) {
      did = scaler.step(opt);
      scaler.update();
    } else {
      sync.synchronize();
      did = !sync.last_step().skipped;
    }
    stepped->push_back(did);
    scales->push_back(scaler.get_scale());
    if (!did) EXPECT_TRUE(equal_bits(snapshot(m->parameters()), before)) << "step " << step;
    for (const auto& p : m->parameters()) EXPECT_TRUE(same_everywhere(p)) << "step " << step;
  }
  return snapshot(m->parameters());
}

}  // namespace

// An inf in one rank's gradient: every rank's average holds it, whatever
// the codec, so every rank skips that step (and only it), halves the scale
// alike and keeps its parameters; the steps after it train (no codec state
// kept the inf). With GradSync stepping (Optimizer, NextForward) the
// parameters equal the trainer's scaler.step path bit for bit.
TEST(GradSyncAmp, AnInfOnOneRankSkipsTheStepOnEveryRankWithEachCodec) {
  for (const auto& codec : kCodecs) {
    for (const Overlap overlap : {Overlap::None, Overlap::Optimizer, Overlap::NextForward}) {
      // (NextForward: two codecs are enough beside Optimizer's six.)
      if (overlap == Overlap::NextForward && codec != "none" && codec != "powersgd:2") continue;
      SCOPED_TRACE(codec + (overlap == Overlap::None        ? " trainer steps"
                            : overlap == Overlap::Optimizer ? " Overlap::Optimizer"
                                                            : " Overlap::NextForward"));
      std::vector<bool> stepped, ref_stepped;
      std::vector<double> scales, ref_scales;
      const auto got = scaled_run(codec, overlap, &stepped, &scales);
      const std::vector<bool> want{true, true, false, true, true};
      EXPECT_EQ(stepped, want);
      // 256, x2 after two clean steps, x0.5 at the inf, then two clean again.
      EXPECT_EQ(scales, (std::vector<double>{256, 512, 256, 256, 512}));
      if (overlap == Overlap::None) continue;
      const auto ref = scaled_run(codec, Overlap::None, &ref_stepped, &ref_scales);
      EXPECT_TRUE(equal_bits(got, ref)) << "GradSync's scaled steps against scaler.step's";
    }
  }
}

// Gradients no reduction averages (each rank steps on its own, e.g. model
// averaging): without GradScalerOptions::process_group only the rank with
// the inf skips and the ranks' scales part; with it every rank skips (one
// MAX all-reduce of the flag).
TEST(GradSyncAmp, TheScalersOwnAllReduceAgreesWhereNoReductionCarriesTheInf) {
  const int r = world()->getRank(), n = world()->getSize();
  for (const bool agree : {false, true}) {
    SCOPED_TRACE(agree ? "process_group set" : "no process_group");
    torch::manual_seed(12);
    Net m;
    torch::optim::SGD opt(m->parameters(), 0.1);
    GradScaler scaler(
        GradScalerOptions().process_group(agree ? world() : ddpx::comm::ProcessGroupPtr()));
    opt.zero_grad();
    scaler.scale(loss_at(m, 0, at::kFloat, r == n - 1)).backward();  // local gradients only
    const bool stepped = scaler.step(opt);
    scaler.update();
    EXPECT_EQ(stepped, !agree && r != n - 1);
    EXPECT_EQ(scaler.get_scale(), agree || r == n - 1 ? 32768.0 : 65536.0);
  }
}

// bfloat16 parameters with float32 masters (reduce in float32): the same
// bits in every overlap mode; the masters within 2% (of the distance the
// float32 run moved) of a float32 run; the parameters the masters rounded;
// their .grad consumed. The optimizer's state is float32, in the optimizer.
TEST(GradSyncAmp, Bf16ParametersWithFloat32MastersFollowAFloat32RunInEveryOverlapMode) {
  constexpr int kSteps = 12;
  auto run = [&](std::optional<Overlap> overlap, std::vector<at::Tensor>* masters) {
    torch::manual_seed(13);
    Net m;
    const bool mixed = overlap.has_value();
    GradSyncOptions o;
    o.overlap(overlap.value_or(Overlap::None)).timed_plans(false);
    if (mixed) o.mixed_precision(at::kBFloat16, at::kFloat);
    GradSync sync(m->named_parameters(), world(), o);
    torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.2).momentum(0.9));
    if (mixed) sync.set_optimizer(opt);
    for (int step = 0; step < kSteps; ++step) {
      if (!mixed) opt.zero_grad();
      if (overlap == Overlap::NextForward) sync.wait_ready(m->parameters());
      loss_at(m, step, mixed ? at::kBFloat16 : at::kFloat, false).backward();
      if (!mixed) opt.step();
    }
    sync.synchronize();
    if (masters) *masters = snapshot(sync.master_parameters());
    if (mixed) {
      for (const auto& p : m->parameters()) {
        EXPECT_EQ(p.scalar_type(), at::kBFloat16);
        EXPECT_FALSE(p.grad().defined()) << "the update consumes the gradient";
      }
      for (const auto& [key, st] : opt.state()) {
        const auto& buf = static_cast<torch::optim::SGDParamState&>(*st).momentum_buffer();
        EXPECT_EQ(buf.scalar_type(), at::kFloat);
      }
    }
    return snapshot(m->parameters());
  };
  std::vector<at::Tensor> start;
  {
    torch::manual_seed(13);
    Net m0;
    start = snapshot(m0->parameters());
  }
  const auto ref = run(std::nullopt, nullptr);
  std::vector<at::Tensor> masters_none;
  const auto none = run(Overlap::None, &masters_none);
  for (const Overlap overlap : {Overlap::Optimizer, Overlap::NextForward}) {
    std::vector<at::Tensor> masters;
    EXPECT_TRUE(equal_bits(run(overlap, &masters), none));
    EXPECT_TRUE(equal_bits(masters, masters_none));
  }
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_TRUE(at::equal(none[i], masters_none[i].to(at::kBFloat16))) << "parameter " << i;
    const double moved = (ref[i] - start[i]).norm().item<double>();
    const double off = (masters_none[i] - ref[i]).norm().item<double>();
    EXPECT_LT(off, 0.02 * moved) << "parameter " << i << ": " << off << " of " << moved;
  }
}

// Where an update is below half a bfloat16 ulp of its weight, pure
// bfloat16 training rounds every step away and stalls (its weights never
// move); float32 masters accumulate the updates and it trains.
TEST(GradSyncAmp, Float32MastersKeepTrainingWherePureBfloat16Stalls) {
  // y = x . w*, w* = 1.01 everywhere, from w = 1 (1.01 is no bfloat16:
  // 1 + 2^-7 is the next): each update ~4e-4, under half an ulp of 1.0 in
  // bfloat16 (2^-9 ~ 2e-3). Returns the weights, float32 (the masters).
  constexpr double kTarget = 1.01;
  auto run = [&](bool masters) {
    torch::nn::Linear m(torch::nn::LinearOptions(8, 1).bias(false));
    {
      torch::NoGradGuard no_grad;
      m->weight.fill_(1.0);
    }
    if (!masters) m->to(at::kBFloat16);
    GradSyncOptions o;
    if (masters) o.mixed_precision(at::kBFloat16, at::kFloat);
    GradSync sync(m->named_parameters(), world(), o);
    torch::optim::SGD opt(m->parameters(), 0.02);
    if (masters) sync.set_optimizer(opt);
    for (int step = 0; step < 60; ++step) {
      const at::Tensor x = shard(global_batch(8, 300 + step), world()->getRank()).to(at::kBFloat16);
      const at::Tensor y = x.to(at::kFloat).sum(1, true) * kTarget;
      if (!masters) opt.zero_grad();
      torch::mse_loss(m(x).to(at::kFloat), y).backward();
      if (!masters) opt.step();
    }
    return masters ? sync.master_parameters()[0].clone() : m->weight.detach().to(at::kFloat);
  };
  const at::Tensor bf16 = run(false), mixed = run(true);
  EXPECT_TRUE(at::equal(bf16, at::ones_like(bf16))) << "pure bfloat16 moved: " << bf16;
  const double left = (mixed - kTarget).abs().max().item<double>();
  EXPECT_LT(left, 0.3 * (kTarget - 1.0)) << "the masters: " << mixed;
}

// reduce_dtype: bfloat16 gradients summed in float32 (SGD at lr 1 moves the
// master by the float32 mean of the ranks' bfloat16 gradients) or in
// bfloat16 (by a bfloat16 sum: within n ulps; the parameter's .grad is then
// its bucket slot, zeroed by the update), and float32 gradients summed in
// bfloat16 (.grad float32, each value a bfloat16, near the mean).
TEST(GradSyncAmp, ReduceDtypeIsTheDtypeGradientsAreSummedIn) {
  const int n = world()->getSize();
  const double bf16_sum = n * std::ldexp(1.0, -8);  // a rounding per addend
  for (const auto& dtypes :
       std::vector<std::pair<at::ScalarType, at::ScalarType>>{{at::kBFloat16, at::kFloat},
                                                              {at::kBFloat16, at::kBFloat16},
                                                              {at::kFloat, at::kBFloat16}}) {
    // (Not a structured binding: clang 14, the sanitizer build's compiler,
    // cannot capture one in the lambda below.)
    const at::ScalarType param = dtypes.first, reduce = dtypes.second;
    SCOPED_TRACE(std::string("mixed_precision(") + c10::toString(param) + ", " +
                 c10::toString(reduce) + ")");
    // d/dw sum(x w^T) = the sum of x's rows: rank r's gradient, known to all.
    auto x_of = [&](int r) { return shard(global_batch(6, 77), r).to(param); };
    at::Tensor mean = at::zeros({6});
    double big = 0;  // the largest |addend|
    for (int r = 0; r < n; ++r) {
      mean += x_of(r).sum(0).to(at::kFloat) / n;
      big = std::max(big, x_of(r).sum(0).abs().max().item<double>());
    }
    torch::nn::Linear m(torch::nn::LinearOptions(6, 1).bias(false));
    GradSync sync(m->named_parameters(), world(), GradSyncOptions().mixed_precision(param, reduce));
    torch::optim::SGD opt(m->parameters(), 1.0);
    const bool masters = param != at::kFloat;
    if (masters) sync.set_optimizer(opt);
    const at::Tensor before = masters ? sync.master_parameters()[0].clone() : at::Tensor();
    m(x_of(world()->getRank())).sum().backward();
    if (masters) {
      const at::Tensor moved = (before - sync.master_parameters()[0]).reshape(-1);
      // (A bfloat16 sum rounds by its addends' size, not the result's.)
      const double tol = reduce == at::kFloat ? 1e-6 : bf16_sum * big;
      EXPECT_TRUE(at::allclose(moved, mean, 1e-6, tol)) << moved << mean;
      const at::Tensor g = m->weight.grad();
      EXPECT_EQ(g.defined(), reduce == param);  // (consumed, or the zeroed slot)
      if (g.defined()) EXPECT_TRUE(at::equal(g, at::zeros_like(g)));
    } else {
      const at::Tensor g = m->weight.grad().reshape(-1);
      EXPECT_EQ(g.scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(g, g.to(at::kBFloat16).to(at::kFloat))) << "summed in bfloat16";
      EXPECT_TRUE(at::allclose(g, mean, 1e-6, bf16_sum * big)) << g << mean;
    }
  }
}

// float16 parameters with float32 masters and the scaler, GradSync
// stepping: an inf on one rank skips the step on every rank (masters and
// parameters kept), the next trains.
TEST(GradSyncAmp, Float16ParametersWithMastersAndTheScalerSkipAlike) {
  const int r = world()->getRank(), n = world()->getSize();
  torch::manual_seed(14);
  Net m;
  GradSync sync(m->named_parameters(), world(),
                GradSyncOptions().mixed_precision(at::kHalf, at::kFloat));
  torch::optim::Adam opt(m->parameters(), 1e-3);
  GradScaler scaler(GradScalerOptions().init_scale(1024));
  sync.set_optimizer(opt, scaler);
  for (int step = 0; step < 4; ++step) {
    const auto before = snapshot(sync.master_parameters());
    scaler.scale(loss_at(m, step, at::kHalf, step == 1 && r == n - 1)).backward();
    EXPECT_EQ(sync.last_step().skipped, step == 1) << "step " << step;
    EXPECT_EQ(equal_bits(snapshot(sync.master_parameters()), before), step == 1);
    for (const auto& p : sync.master_parameters()) EXPECT_TRUE(same_everywhere(p));
  }
  EXPECT_EQ(scaler.get_scale(), 512.0);
}

// A checkpoint of masters (GradSync::State), optimizer and parameters,
// loaded into a fresh model and GradSync, continues bit for bit.
TEST(GradSyncAmp, MastersResumeBitForBit) {
  auto make = [](Net& m, std::unique_ptr<GradSync>& sync, std::unique_ptr<torch::optim::SGD>& opt) {
    sync = std::make_unique<GradSync>(m->named_parameters(), world(),
                                      GradSyncOptions()
                                          .mixed_precision(at::kBFloat16, at::kFloat)
                                          .overlap(Overlap::Optimizer)
                                          .timed_plans(false));
    opt = std::make_unique<torch::optim::SGD>(m->parameters(),
                                              torch::optim::SGDOptions(0.1).momentum(0.9));
    sync->set_optimizer(*opt);
  };
  auto steps = [](Net& m, int from, int to) {
    for (int step = from; step < to; ++step) loss_at(m, step, at::kBFloat16, false).backward();
  };
  torch::manual_seed(15);
  Net straight;
  std::unique_ptr<GradSync> s1;
  std::unique_ptr<torch::optim::SGD> o1;
  make(straight, s1, o1);
  steps(straight, 0, 6);

  torch::manual_seed(15);
  Net first;
  std::unique_ptr<GradSync> s2;
  std::unique_ptr<torch::optim::SGD> o2;
  make(first, s2, o2);
  steps(first, 0, 3);
  const GradSync::State state = s2->state();
  ASSERT_EQ(state.masters.size(), first->parameters().size());
  std::stringstream opt_bytes;
  {
    torch::serialize::OutputArchive ar;
    o2->save(ar);
    ar.save_to(opt_bytes);
  }
  const auto params = snapshot(first->parameters());
  s2.reset();

  torch::manual_seed(99);  // other initial values: all comes from the checkpoint
  Net resumed;
  std::unique_ptr<GradSync> s3;
  std::unique_ptr<torch::optim::SGD> o3;
  make(resumed, s3, o3);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) resumed->parameters()[i].copy_(params[i]);
  }
  torch::serialize::InputArchive ar;
  ar.load_from(opt_bytes);
  o3->load(ar);
  s3->load_state(state);
  steps(resumed, 3, 6);
  EXPECT_TRUE(equal_bits(snapshot(resumed->parameters()), snapshot(straight->parameters())));
  EXPECT_TRUE(equal_bits(snapshot(s3->master_parameters()), snapshot(s1->master_parameters())));
}

// Bad input: a clear error naming the option or the argument.
TEST(GradSyncAmp, BadCombinationsAreNamed) {
  auto expect_error = [](const std::function<void()>& fn, const std::vector<std::string>& words) {
    const std::string e = error_of(fn);
    for (const auto& w : words) EXPECT_NE(e.find(w), std::string::npos) << w << " in: " << e;
  };
  torch::manual_seed(16);
  expect_error(
      [] {
        Net m;
        GradSync s(m->named_parameters(), world(),
                   GradSyncOptions().mixed_precision(at::kDouble, at::kFloat));
      },
      {"param_dtype", "Double"});
  expect_error(
      [] {
        Net m;
        GradSync s(m->named_parameters(), world(),
                   GradSyncOptions()
                       .mixed_precision(at::kBFloat16, at::kFloat)
                       .overlap(Overlap::Optimizer)
                       .staleness(1));
      },
      {"mixed_precision", "staleness(1)"});
  expect_error(
      [] {
        Net m;
        m->to(at::kDouble);
        GradSync s(m->named_parameters(), world(),
                   GradSyncOptions().mixed_precision(at::kBFloat16, at::kFloat));
      },
      {"a.weight", "Double", "float32"});
  expect_error(
      [] {
        Net m;
        GradSync s(m->named_parameters(), world(),
                   GradSyncOptions().mixed_precision(at::kBFloat16, at::kFloat));
        loss_at(m, 0, at::kBFloat16, false).backward();
      },
      {"mixed_precision", "set_optimizer"});
  expect_error(
      [] {
        Net m;
        GradSync s(m->named_parameters(), world());
        torch::optim::SGD opt(m->parameters(), 0.1);
        GradScaler scaler;
        s.set_optimizer(opt, scaler);
      },
      {"Overlap::None", "scaler.step"});
  {
    Net m;
    GradSync s(m->named_parameters(), world(), GradSyncOptions().overlap(Overlap::Optimizer));
    torch::optim::SGD opt(m->parameters(), 0.1);
    GradScaler scaler;
    s.set_optimizer(opt, scaler);
    expect_error([&] { loss_at(m, 0, at::kFloat, false).backward(); }, {"scaler.scale(loss)"});
    scaler.scale(loss_at(m, 0, at::kFloat, false)).backward();
    expect_error([&] { scaler.step(opt); }, {"set_optimizer", "scaler.scale(loss)"});
    expect_error([&] { scaler.update(); }, {"set_optimizer"});
  }
}
