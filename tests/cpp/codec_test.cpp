// Codecs under mpirun (2 and 3 ranks), over ddpx_mpi and Gloo: each codec's
// accuracy contract (exact / dtype tolerance / stated bound), byte counts,
// and clear errors instead of hangs. (Error feedback and per-key state:
// codec_state_test.cpp.)
// Every rank can rebuild every rank's input (seeded by rank), so the reference
// mean is computed locally in float64.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ddpx/codec.h>
#include <ddpx/comm.h>
#include <ddpx/ops.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "codec_test_util.h"
#include "kernels/common/int8_codec.h"

using ddpx::comm::Codec;
using ddpx::comm::make_codec;
using namespace ddpx::test::codec;

namespace {

class CodecTest : public OverBackend {};

const std::vector<std::vector<int64_t>> kShapes = {{1}, {17}, {97}, {5, 7}, {3, 4, 5}, {0}};

TEST_P(CodecTest, NoneEqualsPlainAllreduce) {
  auto c = make_codec("none");
  for (size_t i = 0; i < kShapes.size(); ++i) {
    auto x = input_of(rank(), i, kShapes[i]);
    auto ref = x.clone();
    std::vector<at::Tensor> v{ref};
    pg().allreduce(v)->wait();
    ref.div_(world());
    auto got = c->allreduce_mean(x, "", pg());
    EXPECT_TRUE(at::equal(got, ref)) << "shape " << x.sizes();
    EXPECT_EQ(got.sizes(), x.sizes());
  }
  // Non-contiguous input; double input stays double.
  auto t = input_of(rank(), 50, {6, 4}).t();
  auto ref = t.contiguous();
  std::vector<at::Tensor> v{ref};
  pg().allreduce(v)->wait();
  EXPECT_TRUE(at::equal(c->allreduce_mean(t, "", pg()), ref.div_(world())));
  auto d = input_of(rank(), 51, {9}).to(at::kDouble);
  EXPECT_EQ(c->allreduce_mean(d, "", pg()).scalar_type(), at::kDouble);
}

TEST_P(CodecTest, HalfCodecsWithinDtypeTolerance) {
  for (const auto& [spec, unit] : std::vector<std::pair<std::string, double>>{
           {"fp16", std::ldexp(1.0, -11)}, {"bf16", std::ldexp(1.0, -8)}}) {
    auto c = make_codec(spec);
    for (size_t i = 0; i < kShapes.size(); ++i) {
      auto x = input_of(rank(), 100 + i, kShapes[i]);
      auto want = true_mean(world(), 100 + i, kShapes[i]);
      auto got = c->allreduce_mean(x, "", pg()).to(at::kDouble);
      // Cast of x/w (1 unit roundoff) plus (w - 1) roundings of partial sums,
      // each of at most mean(|x|) in size (+ the result's own rounding).
      auto absmean = at::zeros(kShapes[i], at::kDouble);
      for (int r = 0; r < world(); ++r) absmean += input_of(r, 100 + i, kShapes[i]).abs();
      absmean /= world();
      auto bound = absmean * (world() + 2) * unit + 1e-30;
      EXPECT_TRUE(((got - want).abs() <= bound).all().item<bool>()) << spec << " " << x.sizes();
    }
    // Dividing before reducing: w * 60000 overflows fp16's 65504, the mean does not.
    if (spec == "fp16") {
      auto big = at::full({8}, 60000.0f);
      auto got = c->allreduce_mean(big, "", pg());
      EXPECT_TRUE(at::isfinite(got).all().item<bool>());
      EXPECT_TRUE(at::allclose(got, big, 1e-3));
      auto h = c->allreduce_mean(big.to(at::kHalf), "", pg());
      EXPECT_EQ(h.scalar_type(), at::kHalf);
      EXPECT_TRUE(at::isfinite(h).all().item<bool>());
    }
  }
}

// fp16 / bf16: each rank's x / world rounded to 16 bits, added in rank order
// in float32 and rounded once -- bit for bit, whether the tensor goes alone
// (all-gathered) or packed behind 40001 others (beyond two ranks, the
// all-to-all form with uneven slices): an element's mean does not depend on
// where it sits, so a GradSync run repeats whatever its bucket plan.
TEST_P(CodecTest, HalfCodecsAddInRankOrderWhereverTheTensorSits) {
  for (const auto& [spec, dt] : std::vector<std::pair<std::string, at::ScalarType>>{
           {"fp16", at::kHalf}, {"bf16", at::kBFloat16}}) {
    SCOPED_TRACE(spec);
    auto c = make_codec(spec);
    constexpr int64_t n = 1001, filler = 40001;
    auto want = at::zeros({n}, at::kFloat);
    for (int r = 0; r < world(); ++r) want.add_(input_of(r, 700, {n}).div(world()).to(dt));
    want = want.to(dt).to(at::kFloat);
    const auto x = input_of(rank(), 700, {n});
    EXPECT_TRUE(at::equal(c->allreduce_mean(x, "", pg()), want));
    const auto flat = at::cat({input_of(rank(), 701, {filler}), x});
    const auto packed = c->allreduce_mean_packed(flat, {{filler}, {n}}, "", pg());
    EXPECT_TRUE(at::equal(packed.narrow(0, filler, n), want));
  }
}

TEST_P(CodecTest, Int8WithinStatedBound) {
  for (int64_t chunk : {256, 7}) {
    auto c = make_codec(chunk == 256 ? "int8" : "int8:7");
    for (size_t i = 0; i < kShapes.size(); ++i) {
      const auto& shape = kShapes[i];
      auto x = input_of(rank(), 200 + i, shape, 3.0);
      auto want = true_mean(world(), 200 + i, shape, 3.0).reshape(-1);
      auto got = c->allreduce_mean(x, "", pg()).to(at::kDouble).reshape(-1);
      // Stated bound: sum over ranks of absmax(chunk)/254, divided by w.
      const int64_t n = x.numel();
      auto bound = at::zeros({n}, at::kDouble);
      for (int r = 0; r < world(); ++r) {
        auto xr = input_of(r, 200 + i, shape, 3.0).reshape(-1);
        for (int64_t ch = 0; ch < ddpx::kernels::int8_codec::num_chunks(n, chunk); ++ch) {
          auto part = xr.narrow(0, ch * chunk, std::min(chunk, n - ch * chunk));
          bound.narrow(0, ch * chunk, part.numel()) += part.abs().max().item<double>() / 254;
        }
      }
      bound = bound / world() * (1 + 1e-5) + 1e-6;
      EXPECT_TRUE(((got - want).abs() <= bound).all().item<bool>())
          << c->spec() << " " << at::IntArrayRef(shape);
    }
  }
}

TEST_P(CodecTest, TopKExactOnKSparseInputs) {
  auto c = make_codec("topk:0.1");
  for (int64_t n : {1, 17, 97, 1000}) {
    const int64_t k = (n + 9) / 10;
    // Small integers at k positions per rank (positions differ by rank and
    // overlap): exactly representable, so the mean is exact.
    auto make = [&](int r) {
      auto x = at::zeros({n}, at::kFloat);
      for (int64_t j = 0; j < k; ++j)
        x[(j * 7 + r * 3) % n] = static_cast<float>((j % 5) - 2 + r + 1);
      return x;
    };
    auto sum = at::zeros({n}, at::kFloat);
    for (int r = 0; r < world(); ++r) sum += make(r);
    auto got = c->allreduce_mean(make(rank()), "ks", pg());
    EXPECT_TRUE(at::equal(got, sum / world())) << "n=" << n;
    // k-sparse inputs leave no residual: a second call gives the same.
    EXPECT_TRUE(at::equal(c->allreduce_mean(make(rank()), "ks", pg()), sum / world()));
    c->reset_state();
  }
}

// Large inputs take the sampled-threshold selection: the same entries as a
// full topk, so the mean of every rank's top k, exactly.
TEST_P(CodecTest, TopKOnLargeInputsSelectsTheTrueTopK) {
  const int64_t n = 300007, k = 3001;  // topk:0.01 -> ceil(3000.07)
  auto c = make_codec("topk:0.01");
  auto want = at::zeros({n}, at::kFloat);
  for (int r = 0; r < world(); ++r) {
    auto xr = input_of(r, 1200, {n});
    auto idx = std::get<1>(xr.abs().topk(k));
    want.index_add_(0, idx, xr.index_select(0, idx));
  }
  want.div_(world());
  auto got = c->allreduce_mean(input_of(rank(), 1200, {n}), "", pg());
  EXPECT_EQ((got != 0).sum().item<int64_t>(), (want != 0).sum().item<int64_t>());
  EXPECT_TRUE(at::allclose(got, want, 1e-6, 1e-7));
}

TEST_P(CodecTest, PowerSgdExactOnLowRankInputs) {
  for (int64_t r : {1, 2, 4}) {
    auto c = make_codec("powersgd:" + std::to_string(r));
    // M_i = A B_i^T with A shared: mean(M_i) has rank <= r.
    auto a = input_of(0, 300 + r, {40, r});
    auto b_of = [&](int rr) { return input_of(rr, 310 + r, {30, r}); };
    auto want = at::zeros({40, 30}, at::kFloat);
    for (int rr = 0; rr < world(); ++rr) want += a.mm(b_of(rr).t());
    want /= world();
    auto got = c->allreduce_mean(a.mm(b_of(rank()).t()), "", pg());
    EXPECT_TRUE(at::allclose(got, want, 1e-4, 1e-4 * want.abs().max().item<float>()))
        << "rank " << r << " max err " << (got - want).abs().max().item<float>();
    // Conv-shaped [out, in, kh, kw] is viewed as [out, in*kh*kw].
    auto w4 = a.mm(b_of(rank()).t()).reshape({40, 3, 5, 2});
    EXPECT_TRUE(at::allclose(c->allreduce_mean(w4, "", pg()), want.reshape({40, 3, 5, 2}), 1e-4,
                             1e-4 * want.abs().max().item<float>()));
  }
  // 1-D and tensors that would not shrink go uncompressed: exact, the float32
  // sum in rank order (ordered_sum), divided by the world size.
  auto c = make_codec("powersgd:4");
  for (const auto& shape : std::vector<std::vector<int64_t>>{{97}, {3, 5}, {1, 50}}) {
    auto x = input_of(rank(), 320, shape);
    at::Tensor want = input_of(0, 320, shape);
    for (int r = 1; r < world(); ++r) want.add_(input_of(r, 320, shape));
    want.div_(world());
    const int64_t before = c->stats().bytes_sent;
    EXPECT_TRUE(at::equal(c->allreduce_mean(x, "u", pg()), want));
    EXPECT_EQ(c->stats().bytes_sent - before, 96 + 4 * x.numel()) << at::IntArrayRef(shape);
  }
}

// A packed call (a GradSync bucket) compresses each matrix part as a call
// on that part alone would, in two collectives for all of them, and sends
// the 1-D parts and those that would not shrink as they are. int8 and top-k
// give each part exactly what a call on it alone gives (chunks and budget
// per tensor, issue 47), whatever its neighbours.
TEST_P(CodecTest, PackedPartsCompressEachMatrix) {
  const std::vector<std::vector<int64_t>> shapes{{40, 30}, {17}, {12, 3, 2, 2}, {3, 5}, {0, 4}};
  std::vector<at::Tensor> parts;
  for (size_t i = 0; i < shapes.size(); ++i) parts.push_back(input_of(rank(), 330 + i, shapes[i]));
  std::vector<at::Tensor> flat_parts;
  for (const auto& t : parts) flat_parts.push_back(t.reshape(-1));
  const at::Tensor flat = at::cat(flat_parts);
  for (const std::string spec : {"powersgd:2", "int8", "int8:7", "topk:0.3"}) {
    auto packed = make_codec(spec), alone = make_codec(spec);
    const at::Tensor got = packed->allreduce_mean_packed(flat, shapes, "", pg());
    const auto s = packed->stats();
    EXPECT_EQ(s.calls, 1);
    EXPECT_EQ(s.bytes_raw, 4 * flat.numel());
    if (spec != "powersgd:2") {
      int64_t off = 0;
      for (size_t i = 0; i < shapes.size(); ++i) {
        const at::Tensor want = alone->allreduce_mean(parts[i], "", pg()).reshape(-1);
        EXPECT_TRUE(at::equal(got.narrow(0, off, want.numel()), want))
            << spec << " part " << i << " " << at::IntArrayRef(shapes[i]);
        off += want.numel();
      }
      continue;
    }
    int64_t off = 0;
    for (size_t i = 0; i < shapes.size(); ++i) {
      const at::Tensor want = alone->allreduce_mean(parts[i], "", pg()).reshape(-1);
      EXPECT_TRUE(at::allclose(got.narrow(0, off, want.numel()), want, 1e-5, 1e-6))
          << spec << " part " << i << " " << at::IntArrayRef(shapes[i]);
      off += want.numel();
    }
    // [40,30] -> 2 * (40 + 30); [12,12] -> 2 * (12 + 12); 17 + 15 + 0 as is.
    EXPECT_EQ(s.bytes_sent, 96 + 4 * (2 * (40 + 30) + 2 * (12 + 12) + 17 + 15)) << spec;
  }
  // The parts must fill the input, and every rank must pack alike.
  auto c = make_codec("powersgd:2");
  EXPECT_NE(error_of([&] {
              c->allreduce_mean_packed(flat, {{40, 30}}, "", pg());
            }).find("the parts' shapes hold 1200 elements but the packed input has"),
            std::string::npos);
  const std::vector<std::vector<int64_t>> mine = rank() == 0
                                                     ? std::vector<std::vector<int64_t>>{{4, 6}}
                                                     : std::vector<std::vector<int64_t>>{{6, 4}};
  const std::string err =
      error_of([&] { c->allreduce_mean_packed(at::ones({24}), mine, "", pg()); });
  EXPECT_NE(err.find("disagree on the shape"), std::string::npos) << err;
}

// Error feedback: x_t = c_rank + noise; without feedback, what the codec drops
// of the constant part drifts away linearly; with it, sum(result) - sum(mean)
// = -mean(residual_T) stays bounded.
// fp16/bf16 get a constant input (their cast error is systematic only for a
// repeated input). Feedback compensates each rank's cast, but the rounding of
// the 16-bit sum on the wire belongs to no rank and is not compensated: the
// deviation may grow by at most (w - 1) roundings of the sum per call.
// More than two pipelined pieces (kPieceElements = 2^18) and a ragged last
// one: the pieces join seamlessly, and error feedback covers every piece.
TEST_P(CodecTest, LargeInputsGoInPiecesSeamlessly) {
  const int64_t n = 600011;
  auto x = input_of(rank(), 800, {n});
  for (const std::string spec : {"fp16", "bf16", "int8", "int8:7"}) {
    // int8 pieces hold whole chunks: 2^18 rounded down to a multiple of 7 for int8:7.
    const int64_t piece = spec == "int8:7" ? (int64_t{1} << 18) / 7 * 7 : int64_t{1} << 18;
    auto c = make_codec(spec);
    auto whole = c->allreduce_mean(x, "", pg());
    ASSERT_EQ(whole.sizes(), x.sizes());
    for (int64_t b = 0; b < n; b += piece) {
      const int64_t len = std::min(piece, n - b);
      auto part = c->allreduce_mean(x.narrow(0, b, len), "", pg());
      // Equal up to the order a backend sums 16-bit values in (int8 sums locally).
      EXPECT_TRUE(at::allclose(whole.narrow(0, b, len), part, 1e-2, 1e-3))
          << spec << " piece at " << b;
    }
  }
  // int8 with feedback on a constant input: sum of T results = T mean(x) -
  // mean(residual_T), so the deviation stays within one quantisation step.
  auto c = make_codec("int8");
  auto want = true_mean(world(), 800, {n});
  auto sum = at::zeros({n}, at::kDouble);
  const int steps = 4;
  for (int t = 0; t < steps; ++t) sum += c->allreduce_mean(x, "big", pg()).to(at::kDouble);
  double absmax = 0;
  for (int r = 0; r < world(); ++r) {
    absmax = std::max(absmax, input_of(r, 800, {n}).abs().max().item<double>());
  }
  const double dev = (sum - want * steps).abs().max().item<double>();
  EXPECT_LE(dev, 1.5 * absmax / 254 + 1e-5) << "a piece's residual was not carried";
}

// The same across the pipelined pieces of a large packed call (2^18
// elements each): parts that straddle piece bounds, parts smaller than a
// chunk between them, and a part that fills a piece exactly.
TEST_P(CodecTest, PackedPartsAcrossPiecesAsAlone) {
  const std::vector<std::vector<int64_t>> shapes{{5}, {300001}, {3}, {262144}, {7, 3}, {0}};
  std::vector<at::Tensor> parts, flat_parts;
  for (size_t i = 0; i < shapes.size(); ++i) {
    parts.push_back(input_of(rank(), 340 + i, shapes[i]));
    flat_parts.push_back(parts.back().reshape(-1));
  }
  const at::Tensor flat = at::cat(flat_parts);
  for (const std::string spec : {"int8", "int8:100000", "topk:0.01"}) {
    auto packed = make_codec(spec), alone = make_codec(spec);
    at::Tensor got;
    for (int call = 0; call < 2; ++call) {  // the second call carries the residuals
      got = packed->allreduce_mean_packed(flat, shapes, "k", pg());
      int64_t off = 0;
      for (size_t i = 0; i < shapes.size(); ++i) {
        const at::Tensor want =
            alone->allreduce_mean(parts[i], "k" + std::to_string(i), pg()).reshape(-1);
        EXPECT_TRUE(at::equal(got.narrow(0, off, want.numel()), want))
            << spec << " call " << call << " part " << i;
        off += want.numel();
      }
    }
  }
}

TEST_P(CodecTest, CountsBytesOnTheWire) {
  const int64_t agree = 96;  // 12 int64
  const int64_t n = 1000;
  auto x = input_of(rank(), 600, {n});
  auto x2 = input_of(rank(), 601, {50, 20});
  struct Case {
    std::string spec;
    at::Tensor in;
    int64_t payload;
  };
  for (const auto& [spec, in, payload] :
       std::vector<Case>{{"none", x, 4 * n},
                         {"fp16", x, 2 * n},
                         {"bf16", x, 2 * n},
                         {"int8", x, ddpx::kernels::int8_codec::packed_bytes(n, 256)},
                         {"topk:0.01", x, 8 * 10},
                         {"powersgd:2", x2, 4 * 2 * (50 + 20)}}) {
    auto c = make_codec(spec);
    c->allreduce_mean(in, "", pg());
    c->allreduce_mean(in, "", pg());
    const auto s = c->stats();
    EXPECT_EQ(s.calls, 2) << spec;
    EXPECT_EQ(s.bytes_raw, 2 * 4 * in.numel()) << spec;
    EXPECT_EQ(s.bytes_sent, 2 * (agree + payload)) << spec;
  }
}

TEST_P(CodecTest, MismatchesAcrossRanksAreErrorsOnEveryRank) {
  auto c = make_codec("int8");
  const int64_t n = rank() == 0 ? 5 : 6;
  std::string err = error_of([&] { c->allreduce_mean(at::ones({n}), "", pg()); });
  EXPECT_NE(err.find("disagree on the numel"), std::string::npos) << err;
  err = error_of([&] {
    c->allreduce_mean(rank() == 0 ? at::ones({4}) : at::ones({4}, at::kDouble), "", pg());
  });
  EXPECT_NE(err.find("dtype"), std::string::npos) << err;
  err = error_of([&] { c->allreduce_mean(at::ones({4}), rank() == 0 ? "a" : "b", pg()); });
  EXPECT_NE(err.find("key"), std::string::npos) << err;
  auto other = make_codec(rank() == 0 ? "fp16" : "bf16");
  err = error_of([&] { other->allreduce_mean(at::ones({4}), "", pg()); });
  EXPECT_NE(err.find("codec"), std::string::npos) << err;
  // The group is still usable.
  EXPECT_TRUE(at::equal(c->allreduce_mean(at::zeros({4}), "", pg()), at::zeros({4})));
}

TEST_P(CodecTest, UnsupportedDtypesAreRejectedAtTheDoor) {
  for (const auto& spec : {"none", "fp16", "int8", "topk:0.5", "powersgd:1"}) {
    auto c = make_codec(spec);
    auto err = error_of([&] { c->allreduce_mean(at::ones({4}, at::kLong), "", pg()); });
    EXPECT_NE(err.find("must be float32, float64, float16 or bfloat16, got Long"),
              std::string::npos)
        << err;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, CodecTest, ::testing::Values("ddpx_mpi", "gloo"),
                         [](const auto& info) { return info.param; });

TEST(CodecSpec, BadSpecsListTheValidCodecs) {
  for (const auto& bad :
       {"", "zip", "topk", "topk:0", "topk:1.5", "topk:abc", "powersgd", "powersgd:0",
        "powersgd:2x", "int8:x", "int8:0", "none:1", "fp16:2", "FP16"}) {
    auto err = error_of([&] { make_codec(bad); });
    EXPECT_NE(err.find("valid codecs:"), std::string::npos) << "'" << bad << "': " << err;
    EXPECT_NE(err.find("powersgd:<rank>"), std::string::npos) << err;
  }
  EXPECT_EQ(make_codec("topk:0.010")->spec(), "topk:0.01");
  EXPECT_EQ(make_codec("int8:256")->spec(), "int8");
  EXPECT_EQ(make_codec("powersgd:4")->spec(), "powersgd:4");
}

// The op (through the dispatcher) on the world group equals a codec object.
TEST(CompressedAllreduceOp, MatchesTheCodecOnTheWorldGroup) {
  auto world = ddpx::comm::world();
  for (const auto& spec : {"none", "fp16", "int8", "topk:0.2", "powersgd:2"}) {
    auto x = input_of(world->getRank(), 700, {9, 8});
    auto want = make_codec(spec)->allreduce_mean(x, "", *world);
    EXPECT_TRUE(at::equal(ddpx::compressed_allreduce(x, spec, "", ""), want)) << spec;
  }
  auto err = error_of([] { ddpx::compressed_allreduce(at::ones({2}), "none", "", "no-such"); });
  EXPECT_NE(err.find("'no-such' is not a registered process group"), std::string::npos) << err;
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
