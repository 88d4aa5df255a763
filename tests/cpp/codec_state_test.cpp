// Codecs' state under mpirun (2 and 3 ranks), over ddpx_mpi and Gloo: error
// feedback (residuals tracking the running sum, taken back on demand, none
// left by non-finite inputs), PowerSGD's warm starts per part key, and state
// kept per key and isolated between keys.
#include <ATen/ATen.h>
#include <ddpx/codec.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "codec_test_util.h"

using ddpx::comm::Codec;
using ddpx::comm::make_codec;
using namespace ddpx::test::codec;

namespace {

class CodecState : public OverBackend {};

TEST_P(CodecState, ErrorFeedbackTracksRunningSum) {
  for (const std::string spec : {"topk:0.05", "int8", "powersgd:1", "fp16", "bf16"}) {
    auto c = make_codec(spec);
    const bool half = spec == "fp16" || spec == "bf16";
    const std::vector<int64_t> shape{16, 12};
    auto constant = input_of(rank(), 400, shape);
    const double noise_scale = half ? 0.0 : 0.1;
    const int steps = 60;
    double early_max = 0, late_max = 0, dev_ef = 0, dev_plain = 0;
    for (const bool ef : {true, false}) {
      auto sum_got = at::zeros(shape, at::kDouble), sum_want = at::zeros(shape, at::kDouble);
      for (int t = 0; t < steps; ++t) {
        auto noise = input_of(rank(), 1000 + t, shape, noise_scale);
        auto got = c->allreduce_mean(constant + noise, ef ? "ef" : "", pg());
        sum_got += got.to(at::kDouble);
        sum_want +=
            true_mean(world(), 400, shape) + true_mean(world(), 1000 + t, shape, noise_scale);
        const double dev = (sum_got - sum_want).abs().max().item<double>();
        double& window = t < steps / 2 ? early_max : late_max;
        if (ef) window = std::max(window, dev);
        if (t == steps - 1) (ef ? dev_ef : dev_plain) = dev;
      }
    }
    const double step = true_mean(world(), 400, shape).abs().max().item<double>();
    if (half) {
      auto absmean = at::zeros(shape, at::kDouble);
      for (int r = 0; r < world(); ++r) absmean += input_of(r, 400, shape).abs();
      const double unit = std::ldexp(1.0, spec == "fp16" ? -11 : -8);
      const double per_call = (world() - 1) * unit * (absmean / world()).max().item<double>();
      EXPECT_LE(dev_ef, steps * per_call * 1.01 + 2 * unit * step) << spec;
    } else {
      EXPECT_LT(dev_ef, 0.5 * dev_plain) << spec << ": feedback must beat no feedback";
      EXPECT_LE(late_max, 1.5 * early_max + 0.05 * step)
          << spec << ": the deviation must stay bounded, not grow with the number of calls";
    }
    c->reset_state();
  }
}

// A GradScaler skips a step whose averaged gradients hold an inf or NaN
// (ddpx/amp.h), so each codec's mean must be non-finite wherever any rank's
// input is, bit for bit alike on every rank -- int8 through its chunk's
// scale, top-k through the values it sends, PowerSGD through its factors
// (the whole matrix), fp16 also where x/world overflows its 65504 -- and its
// state must not keep it: the next call, on finite inputs, is finite again
// (a NaN residual or warm start would poison every later step).
TEST_P(CodecState, NonFiniteInputsReachEveryRanksMeanAndLeaveNoState) {
  const std::vector<int64_t> shape{16, 12};  // PowerSGD:2 compresses it: (16 + 12) * 2 < 192
  const double inf = std::numeric_limits<double>::infinity();
  const double overflow = 1e5 * world();  // fp16 only: x / world beyond 65504
  const int who = world() - 1;            // the one rank that sees it
  // Hashes of a tensor's bits, MAX-reduced with their negations: equal on
  // every rank iff the ranks' bits agree (as far as the hashes tell).
  auto same_everywhere = [&](const at::Tensor& t) {
    const at::Tensor bits = t.contiguous().view(at::kInt).to(at::kLong);
    const int64_t h =
        (bits * at::arange(1, bits.numel() + 1, at::kLong).view(t.sizes())).sum().item<int64_t>();
    std::vector<at::Tensor> v{at::tensor({h, -h}, at::kLong)};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    pg().allreduce(v, o)->wait();
    return v[0][0].item<int64_t>() == -v[0][1].item<int64_t>();
  };
  for (const std::string spec : {"none", "fp16", "bf16", "int8", "topk:0.1", "powersgd:2"}) {
    for (const double bad : {inf, -inf, std::nan(""), overflow}) {
      if (bad == overflow && spec != "fp16") continue;
      SCOPED_TRACE(spec + " with " + std::to_string(bad));
      auto c = make_codec(spec);
      c->allreduce_mean(input_of(rank(), 600, shape), "k", pg());  // some state to poison
      at::Tensor x = input_of(rank(), 601, shape);
      if (rank() == who) x[3][5] = bad;
      const at::Tensor got = c->allreduce_mean(x, "k", pg());
      EXPECT_FALSE(std::isfinite(got[3][5].item<float>()));
      EXPECT_TRUE(same_everywhere(got));
      if (spec == "none" || spec == "fp16" || spec == "bf16" || spec == "topk:0.1") {
        EXPECT_EQ(at::isfinite(got).logical_not().sum().item<int64_t>(), 1);  // that one alone
      }
      for (int64_t seed : {602, 603}) {
        const at::Tensor next = c->allreduce_mean(input_of(rank(), seed, shape), "k", pg());
        EXPECT_TRUE(at::isfinite(next).all().item<bool>()) << "call after it, seed " << seed;
      }
    }
  }
}

// take_residuals hands over what the contributions did not carry (top-k: the
// input without its k largest entries) and leaves the codec stateless.
TEST_P(CodecState, TakeResidualsReturnsWhatWasNotSentAndClearsTheState) {
  auto c = make_codec("topk:0.1");
  auto x = input_of(rank(), 510, {12, 10});
  auto first = c->allreduce_mean(x, "a", pg());
  c->allreduce_mean(x, "", pg());  // stateless: no residual
  auto taken = c->take_residuals();
  ASSERT_EQ(taken.size(), 1u);
  ASSERT_EQ(taken.count("a"), 1u);
  auto want = x.reshape(-1).to(at::kFloat).clone();
  want.index_fill_(0, std::get<1>(want.abs().topk(12)), 0.0);
  EXPECT_TRUE(at::equal(taken["a"], want));
  EXPECT_TRUE(c->take_residuals().empty());
  EXPECT_TRUE(at::equal(c->allreduce_mean(x, "a", pg()), first)) << "state left behind";
}

// PowerSGD's warm start under a part key belongs to the tensor, not to the
// packing: it survives take_residuals (a re-plan) and another packing of the
// same tensor, and warm_starts / load_warm_starts carry it to a new codec.
// Without part keys it is the call's and goes with take_residuals.
TEST_P(CodecState, PowerSgdWarmStartsFollowTheirPartKeys) {
  const at::Tensor a = input_of(rank(), 520, {12, 10}), b = input_of(rank(), 521, {9, 14});
  const at::Tensor ab = at::cat({a.reshape(-1), b.reshape(-1)});
  const std::vector<std::vector<int64_t>> sa{{12, 10}}, sb{{9, 14}}, sab{{12, 10}, {9, 14}};
  const at::Tensor fb = b.reshape(-1);
  // Both tensors in one call, then B alone after a re-plan.
  auto c1 = make_codec("powersgd:2");
  c1->allreduce_mean_packed(ab, sab, "k1", pg(), {"A", "B"});
  const auto warm = c1->warm_starts();
  ASSERT_EQ(warm.size(), 2u);
  EXPECT_EQ(warm.at("A").sizes(), at::IntArrayRef({2, 10}));
  EXPECT_EQ(warm.at("B").sizes(), at::IntArrayRef({2, 14}));
  c1->take_residuals();
  EXPECT_EQ(c1->warm_starts().size(), 2u) << "a re-plan dropped the warm starts";
  const at::Tensor r1 = c1->allreduce_mean_packed(fb, sb, "k2", pg(), {"B"});
  // Each tensor in a call of its own: the same warm start for B.
  auto c2 = make_codec("powersgd:2");
  c2->allreduce_mean_packed(a.reshape(-1), sa, "x", pg(), {"A"});
  c2->allreduce_mean_packed(fb, sb, "y", pg(), {"B"});
  EXPECT_TRUE(at::equal(c2->warm_starts().at("B"), warm.at("B")));
  c2->take_residuals();
  EXPECT_TRUE(at::equal(c2->allreduce_mean_packed(fb, sb, "k2", pg(), {"B"}), r1));
  // A checkpoint's warm starts in a new codec.
  auto c3 = make_codec("powersgd:2");
  c3->load_warm_starts(warm);
  EXPECT_TRUE(at::equal(c3->allreduce_mean_packed(fb, sb, "k2", pg(), {"B"}), r1));
  // Controls: without part keys the warm start is the call's, and goes; a
  // cold start gives another result.
  auto c4 = make_codec("powersgd:2");
  c4->allreduce_mean_packed(ab, sab, "k1", pg());
  EXPECT_TRUE(c4->warm_starts().empty());
  c4->take_residuals();
  EXPECT_FALSE(at::equal(c4->allreduce_mean_packed(fb, sb, "k2", pg(), {"B"}), r1));
  // One key per part or none.
  EXPECT_NE(error_of([&] {
              c4->allreduce_mean_packed(ab, sab, "k1", pg(), {"A"});
            }).find("part_keys must be empty or one per part (2), got 1"),
            std::string::npos);
}

TEST_P(CodecState, StatePersistsPerKeyAndIsIsolated) {
  for (const std::string spec : {"topk:0.1", "int8", "powersgd:2", "fp16"}) {
    auto c = make_codec(spec);
    auto x = input_of(rank(), 500, {12, 10});
    auto y = input_of(rank(), 501, {12, 10});
    auto first = c->allreduce_mean(x, "a", pg());
    auto second = c->allreduce_mean(x, "a", pg());
    EXPECT_FALSE(at::equal(first, second)) << spec << ": the key's state must change the result";
    // Same history of "a" with calls under "b" and "" interleaved.
    c->reset_state("a");
    EXPECT_TRUE(at::equal(c->allreduce_mean(x, "a", pg()), first)) << spec;
    c->allreduce_mean(y, "b", pg());
    c->allreduce_mean(y, "", pg());
    EXPECT_TRUE(at::equal(c->allreduce_mean(x, "a", pg()), second)) << spec;
    // "" is stateless.
    EXPECT_TRUE(at::equal(c->allreduce_mean(x, "", pg()), c->allreduce_mean(x, "", pg())));
    EXPECT_TRUE(at::equal(c->allreduce_mean(x, "", pg()), first)) << spec;
    // A key reused with another size is an error on every rank, not a hang.
    EXPECT_NE(error_of([&] {
                c->allreduce_mean(at::zeros({7, 3}), "a", pg());
              }).find("key 'a'"),
              std::string::npos)
        << spec;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, CodecState, ::testing::Values("ddpx_mpi", "gloo"),
                         [](const auto& info) { return info.param; });

}  // namespace
