#pragma once
// What the CUDA conv kernels' CPU emulation tests share (test_conv_tiles.cpp,
// test_conv_tiles_small.cpp): the case table's row, its geometry and name,
// and the checks every emulated launch ends with.
#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/common/conv_tile.h"

namespace ddpx_test {

using ddpx::detail::tile::ConvGeom;

struct Case {
  int64_t n, c, h, w, cout, kh, kw, sh, sw, ph, pw, dh, dw, groups;
};

inline ConvGeom geom(const Case& k) {
  ConvGeom g{k.n,  k.c,  k.h,  k.w,  k.cout, k.kh, k.kw,     0, 0,
             k.sh, k.sw, k.ph, k.pw, k.dh,   k.dw, k.groups, 0, 0};
  g.oh = (k.h + 2 * k.ph - k.dh * (k.kh - 1) - 1) / k.sh + 1;
  g.ow = (k.w + 2 * k.pw - k.dw * (k.kw - 1) - 1) / k.sw + 1;
  g.cig = k.c / k.groups;
  g.cog = k.cout / k.groups;
  return g;
}

inline std::string name(const Case& k) {
  // (c10::str: GCC 12 warns falsely about a chain of std::string operator+.)
  return c10::str("n", k.n, "c", k.c, "_", k.h, "x", k.w, "_o", k.cout, "_k", k.kh, "x", k.kw, "_s",
                  k.sh, k.sw, "_p", k.ph, k.pw, "_d", k.dh, k.dw, "_g", k.groups);
}

// Every element of a row-major ph x pw patch whose origin is input (iy0, ix0)
// was loaded, and holds the input there, or zero where it hangs over the padding.
inline void expect_patch(const ConvGeom& g, const double* src, int64_t iy0, int64_t ix0, int64_t ph,
                         int64_t pw, const double* patch) {
  for (int64_t e = 0; e < ph * pw; ++e) {
    const int64_t iy = iy0 + e / pw, ix = ix0 + e % pw;
    const bool inside = iy >= 0 && iy < g.h && ix >= 0 && ix < g.w;
    ASSERT_FALSE(std::isnan(patch[e])) << "patch element " << e << " never loaded";
    ASSERT_EQ(patch[e], inside ? src[iy * g.w + ix] : 0.0) << "at (" << iy << "," << ix << ")";
  }
}

// Each output written exactly once (writes counts them), and out equals ref.
inline void expect_each_output_once(const std::vector<int>& writes, const at::Tensor& out,
                                    const at::Tensor& ref) {
  for (size_t i = 0; i < writes.size(); ++i) ASSERT_EQ(writes[i], 1) << "output " << i;
  EXPECT_TRUE(at::allclose(out, ref, 1e-10, 1e-10)) << (out - ref).abs().max().item<double>();
}

// A case's tensors in double: input, weight, ATen's output, a grad_output.
class ConvCaseTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const Case& k = GetParam();
    g = geom(k);
    at::manual_seed(42);
    const auto opts = at::TensorOptions().dtype(at::kDouble);
    x = at::randn({k.n, k.c, k.h, k.w}, opts);
    wt = at::randn({k.cout, k.c / k.groups, k.kh, k.kw}, opts);
    ref = at::conv2d(x, wt, {}, {k.sh, k.sw}, {k.ph, k.pw}, {k.dh, k.dw}, k.groups);
    go = at::randn_like(ref);
  }
  ConvGeom g{};
  at::Tensor x, wt, ref, go;
};

}  // namespace ddpx_test
