// The int8 codec's layout and element math (kernels/common/int8_codec.h) and
// its CPU kernels (ddpx::_int8_pack / _int8_unpack_sum) against an ATen
// reference. Single process.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kernels/common/int8_codec.h"
#include "ops/int8_codec.h"

namespace ic = ddpx::kernels::int8_codec;

namespace {

using ddpx::detail::int8_pack;
using ddpx::detail::int8_pack_ef;
using ddpx::detail::int8_unpack_sum;
using ddpx::detail::int8_unpack_sum_out;

// ATen reference of pack: per-chunk absmax scale, rint(x / scale) clamped.
std::pair<at::Tensor, at::Tensor> reference(const at::Tensor& x, int64_t chunk) {
  const int64_t n = x.numel(), c = ic::num_chunks(n, chunk);
  auto padded = at::zeros({c * chunk}, x.options());
  padded.narrow(0, 0, n).copy_(x);
  auto scales = padded.view({c, chunk}).abs().amax(1).div(127.0f);
  auto safe = at::where(scales > 0, scales, at::ones_like(scales));
  auto codes = padded.view({c, chunk})
                   .div(safe.unsqueeze(1))
                   .clamp(-127, 127)
                   .round()
                   .to(at::kChar)
                   .view(-1)
                   .narrow(0, 0, n);
  return {codes, scales};
}

}  // namespace

TEST(Int8Layout, SizesAndAlignment) {
  EXPECT_EQ(ic::num_chunks(0, 256), 0);
  EXPECT_EQ(ic::num_chunks(1, 256), 1);
  EXPECT_EQ(ic::num_chunks(256, 256), 1);
  EXPECT_EQ(ic::num_chunks(257, 256), 2);
  EXPECT_EQ(ic::scales_offset(17), 20);
  EXPECT_EQ(ic::scales_offset(20), 20);
  EXPECT_EQ(ic::packed_bytes(17, 4), 20 + 4 * 5);
  for (int64_t n : {0, 1, 3, 17, 97, 1000}) {
    EXPECT_EQ(ic::packed_bytes(n, 7) % 4, 0) << "n=" << n;
    EXPECT_EQ(ic::chunk_end(ic::num_chunks(n, 7) - 1, 7, n), n) << "n=" << n;
  }
  EXPECT_EQ(ic::chunk_begin(3, 7), 21);
  EXPECT_EQ(ic::chunk_end(2, 7, 17), 17);
}

TEST(Int8Math, EncodeDecodeWithinHalfAStep) {
  const float absmax = 3.7f, s = ic::scale_of(absmax);
  for (float x = -absmax; x <= absmax; x += 0.01f) {
    const float y = ic::decode(ic::encode(x, s), s);
    EXPECT_LE(std::fabs(y - x), s / 2 * (1 + 1e-5f)) << "x=" << x;
  }
  EXPECT_EQ(ic::encode(absmax, s), 127);
  EXPECT_EQ(ic::encode(-absmax, s), -127);
  EXPECT_EQ(ic::encode(0.0f, 0.0f), 0);  // an all-zero chunk
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(ic::encode(1.0f, ic::scale_of(nan)), 0);
  EXPECT_TRUE(std::isnan(ic::decode(0, ic::scale_of(nan))));  // NaN reaches the result
}

class Int8Kernel : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(Int8Kernel, PackMatchesReferenceAndUnpackSums) {
  const auto [n, chunk] = GetParam();
  auto g = at::make_generator<at::CPUGeneratorImpl>(n * 31 + chunk);
  auto x = at::randn({n}, g, at::kFloat) * 5;
  if (n > 3) x[2] = 0.5f;  // chunks of mixed magnitude
  auto msg = int8_pack(x, chunk);
  ASSERT_EQ(msg.numel(), ic::packed_bytes(n, chunk));
  const auto [codes, scales] = reference(x, chunk);
  EXPECT_TRUE(at::equal(msg.narrow(0, 0, n).view(at::kChar), codes));
  auto got_scales =
      msg.narrow(0, ic::scales_offset(n), 4 * ic::num_chunks(n, chunk)).clone().view(at::kFloat);
  EXPECT_TRUE(at::equal(got_scales, scales));
  for (int64_t i = n; i < ic::scales_offset(n); ++i) EXPECT_EQ(msg[i].item<uint8_t>(), 0);

  // Sum of three messages == sum of their reference decodes.
  auto y = at::randn({n}, g, at::kFloat);
  auto z = at::zeros({n}, at::kFloat);
  auto all = at::stack({msg, int8_pack(y, chunk), int8_pack(z, chunk)});
  // (Plain copies: clang 14 cannot capture structured bindings.)
  auto decode_ref = [&, n = n, chunk = chunk](const at::Tensor& t) {
    const auto [c, s] = reference(t, chunk);
    auto sc = s.repeat_interleave(chunk).narrow(0, 0, n);
    return c.to(at::kFloat) * sc;
  };
  auto want = decode_ref(x) + decode_ref(y);
  auto got = int8_unpack_sum(all, n, chunk);
  EXPECT_TRUE(at::allclose(got, want, 1e-6, 1e-6));
  // Quantisation bound: |decode(x) - x| <= absmax(chunk) / 254.
  auto err = (int8_unpack_sum(msg.view({1, -1}), n, chunk) - x).abs();
  auto bound = scales.repeat_interleave(chunk).narrow(0, 0, n) / 2 * (1 + 1e-5) + 1e-7;
  EXPECT_TRUE((err <= bound).all().item<bool>());

  // alpha scales the sum; the out form writes the same into a given buffer.
  auto out = at::full({n}, 7.0f);
  int8_unpack_sum_out(all, n, chunk, 0.25, out);
  EXPECT_TRUE(at::allclose(out, want * 0.25, 1e-6, 1e-6));
  EXPECT_TRUE(at::equal(int8_unpack_sum(all, n, chunk, 0.25), out));
}

TEST_P(Int8Kernel, ErrorFeedbackPackIsPackOfTheSumAndKeepsWhatItDropped) {
  const auto [n, chunk] = GetParam();
  auto g = at::make_generator<at::CPUGeneratorImpl>(n * 17 + chunk);
  auto x = at::randn({n}, g, at::kFloat);
  auto e = at::randn({n}, g, at::kFloat) * 0.1;
  const auto m = x + e;
  const auto want = int8_pack(m, chunk);
  auto residual = e.clone();
  EXPECT_TRUE(at::equal(int8_pack_ef(x, residual, chunk), want));
  // What the message did not carry, to the bit.
  EXPECT_TRUE(at::equal(residual, m - int8_unpack_sum(want.view({1, -1}), n, chunk)));
}

INSTANTIATE_TEST_SUITE_P(Shapes, Int8Kernel,
                         ::testing::Combine(::testing::Values(0, 1, 17, 97, 4099),
                                            ::testing::Values(1, 7, 256)),
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_chunk" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(Int8Kernel, RejectsBadArguments) {
  EXPECT_THROW(int8_pack(at::zeros({4}, at::kDouble), 4), c10::Error);
  EXPECT_THROW(int8_pack(at::zeros({2, 2}, at::kFloat), 4), c10::Error);
  EXPECT_THROW(int8_pack(at::zeros({4}, at::kFloat), 0), c10::Error);
  EXPECT_THROW(int8_unpack_sum(at::zeros({1, 7}, at::kByte), 4, 4), c10::Error);
  auto residual = at::zeros({3}, at::kFloat);
  EXPECT_THROW(int8_pack_ef(at::zeros({4}, at::kFloat), residual, 4), c10::Error);
  auto out = at::zeros({3}, at::kFloat);
  EXPECT_THROW(int8_unpack_sum_out(int8_pack(at::zeros({4}, at::kFloat), 4).view({1, -1}), 4, 4,
                                   1.0, out),
               c10::Error);
}

// Per-part chunks (the `parts` argument): the message is the parts' own
// messages merged (codes end to end, then every part's scales in order), the
// residual the same as packing each part alone, and decoding gives each
// part's own decoded sum: what a tensor becomes does not depend on its
// neighbours in a bucket.
class Int8Parts : public ::testing::TestWithParam<std::vector<int64_t>> {};

TEST_P(Int8Parts, EachPartAsIfPackedAlone) {
  const std::vector<int64_t> parts = GetParam();
  int64_t n = 0;
  for (int64_t m : parts) n += m;
  for (int64_t chunk : {1, 7, 256}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    auto g = at::make_generator<at::CPUGeneratorImpl>(n * 7 + chunk);
    auto x = at::randn({n}, g, at::kFloat) * 3;
    auto e = at::randn({n}, g, at::kFloat) * 0.1;
    auto e_parts = e.clone();
    auto msg = int8_pack_ef(x, e, chunk, parts);
    auto plain = int8_pack(x, chunk, parts);
    std::vector<at::Tensor> codes, scales, alone_msgs;
    int64_t off = 0, chunks = 0;
    for (int64_t m : parts) {
      auto ep = e_parts.narrow(0, off, m);
      auto alone = int8_pack_ef(x.narrow(0, off, m).contiguous(), ep, chunk);
      alone_msgs.push_back(int8_pack(x.narrow(0, off, m).contiguous(), chunk));
      codes.push_back(alone.narrow(0, 0, m));
      scales.push_back(alone.narrow(0, ic::scales_offset(m), 4 * ic::num_chunks(m, chunk)));
      chunks += ic::num_chunks(m, chunk);
      off += m;
    }
    ASSERT_EQ(msg.numel(), ic::packed_bytes_for_chunks(n, chunks));
    EXPECT_TRUE(at::equal(msg.narrow(0, 0, n), at::cat(codes))) << "codes";
    EXPECT_TRUE(at::equal(msg.narrow(0, ic::scales_offset(n), 4 * chunks), at::cat(scales)))
        << "scales";
    EXPECT_TRUE(at::equal(e, e_parts)) << "residual";
    // Two rows (ranks) decoded with parts equal each part decoded alone.
    auto rows = at::stack({msg, plain});
    auto sum = int8_unpack_sum(rows, n, chunk, 0.5, parts);
    off = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t m = parts[i];
      auto alone_rows = at::stack({at::cat({codes[i], at::zeros({ic::scales_offset(m) - m},
                                                                at::kByte), scales[i]}),
                                   alone_msgs[i]});
      EXPECT_TRUE(at::equal(sum.narrow(0, off, m), int8_unpack_sum(alone_rows, m, chunk, 0.5)))
          << "part " << i;
      off += m;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, Int8Parts,
                         ::testing::Values(std::vector<int64_t>{5},
                                           std::vector<int64_t>{3, 300, 1, 0, 257},
                                           std::vector<int64_t>{0, 0},
                                           std::vector<int64_t>{256, 256, 9}));

TEST(Int8Parts, OnePartIsTheUniformLayout) {
  auto x = at::randn({1000}, at::kFloat);
  EXPECT_TRUE(at::equal(int8_pack(x, 256, std::vector<int64_t>{1000}), int8_pack(x, 256)));
}

TEST(Int8Parts, RejectsBadParts) {
  auto x = at::zeros({10}, at::kFloat);
  auto expect_msg = [](const std::function<void()>& f, const std::string& want) {
    try {
      f();
      ADD_FAILURE() << "no error; wanted: " << want;
    } catch (const c10::Error& err) {
      EXPECT_NE(std::string(err.what()).find(want), std::string::npos) << err.what();
    }
  };
  expect_msg([&] { int8_pack(x, 4, std::vector<int64_t>{3, 3}); }, "parts must sum to the 10");
  expect_msg([&] { int8_pack(x, 4, std::vector<int64_t>{12, -2}); }, "parts must hold numels >= 0");
  auto msg = int8_pack(x, 4, std::vector<int64_t>{5, 5});  // 4 chunks; uniform has 3
  expect_msg([&] { int8_unpack_sum(msg.view({1, -1}), 10, 4); }, "bytes per row");
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
