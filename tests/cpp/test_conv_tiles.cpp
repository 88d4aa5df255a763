// Drives the CUDA kernels' tile/halo/index math (kernels/common/conv_tile.h)
// on the CPU: every block and every thread of a launch is emulated in turn,
// with the same functions the kernels call, and the result is compared with
// at::conv2d / at::convolution_backward in double (tolerance 1e-10: only the
// summation order differs). Also checks that every output is written exactly
// once and that halo loads put zeros exactly where the patch hangs over the
// padding.
#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/common/conv_tile.h"
#include "kernels/common/conv_tile_small.h"
#include "conv_tiles_test_util.h"

namespace {

using namespace ddpx_test;  // NOLINT(build/namespaces): the shared case table
namespace tile = ddpx::detail::tile;

class ConvTiles : public ConvCaseTest {};

// The direct path, block by block; inside a block, "threads" run phase by
// phase the way __syncthreads() separates them in the kernel.
TEST_P(ConvTiles, DirectPathEmulationMatchesAten) {
  constexpr int TH = 4, TW = 8;  // small tiles: many blocks, many borders
  const auto grid = tile::direct_grid(g, TH, TW);
  const int64_t ph_ = tile::patch_h(g, TH), pw_ = tile::patch_w(g, TW);
  const double* xp = x.data_ptr<double>();
  const double* wp = wt.data_ptr<double>();
  at::Tensor out = at::zeros_like(ref);
  std::vector<int> writes(out.numel(), 0);
  double* op = out.data_ptr<double>();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const int64_t kk = g.kh * g.kw;
  for (int64_t plane = 0; plane < grid.planes; ++plane) {
    const int64_t nn = plane / g.cout, oc = plane % g.cout, grp = oc / g.cog;
    for (int64_t by = 0; by < grid.tiles_y; ++by) {
      for (int64_t bx = 0; bx < grid.tiles_x; ++bx) {
        std::vector<double> acc(TH * TW, 0.0);
        const int64_t iy0 = tile::patch_origin_y(g, by, TH), ix0 = tile::patch_origin_x(g, bx, TW);
        for (int64_t icg = 0; icg < g.cig; ++icg) {
          std::vector<double> patch(ph_ * pw_, nan);
          const double* src = xp + (nn * g.c + grp * g.cig + icg) * g.h * g.w;
          for (int tid = 0; tid < TH * TW; ++tid) {
            tile::load_patch(src, g.h, g.w, iy0, ix0, ph_, pw_, patch.data(), tid, TH * TW);
          }
          ASSERT_NO_FATAL_FAILURE(expect_patch(g, src, iy0, ix0, ph_, pw_, patch.data()));
          for (int ly = 0; ly < TH; ++ly) {
            for (int lx = 0; lx < TW; ++lx) {
              acc[ly * TW + lx] +=
                  tile::patch_dot(g, patch.data(), pw_, ly, lx, wp + (oc * g.cig + icg) * kk);
            }
          }
        }
        for (int ly = 0; ly < TH; ++ly) {
          for (int lx = 0; lx < TW; ++lx) {
            int64_t oy, ox;
            if (!tile::tile_output(g, by, bx, TH, TW, ly, lx, &oy, &ox)) continue;
            const int64_t off = ((nn * g.cout + oc) * g.oh + oy) * g.ow + ox;
            op[off] = acc[ly * TW + lx];
            ++writes[off];
          }
        }
      }
    }
  }
  expect_each_output_once(writes, out, ref);
}

// The implicit-GEMM path with deliberately small tiles (so M, N and K all have
// ragged edges), each block's loads done by every emulated thread.
TEST_P(ConvTiles, GemmPathEmulationMatchesAten) {
  constexpr int BM = 8, BN = 16, BK = 4, NT = 16;
  const double* xp = x.data_ptr<double>();
  const double* wp = wt.data_ptr<double>();
  at::Tensor out = at::zeros_like(ref);
  std::vector<int> writes(out.numel(), 0);
  double* op = out.data_ptr<double>();
  const int64_t kc = g.cig * g.kh * g.kw, pixels = g.n * g.oh * g.ow;
  for (int64_t grp = 0; grp < g.groups; ++grp) {
    for (int64_t m0 = 0; m0 < g.cog; m0 += BM) {
      for (int64_t p0 = 0; p0 < pixels; p0 += BN) {
        double c[BM][BN] = {};
        for (int64_t k0 = 0; k0 < kc; k0 += BK) {
          double As[BK][BM], Bs[BK][BN];
          for (int tid = 0; tid < NT; ++tid) {
            tile::gemm_load_tiles<BM, BN, BK>(g, xp, wp, grp, m0, p0, k0, As, Bs, tid, NT);
          }
          for (int kk = 0; kk < BK; ++kk) {
            for (int i = 0; i < BM; ++i) {
              for (int j = 0; j < BN; ++j) c[i][j] += As[kk][i] * Bs[kk][j];
            }
          }
        }
        for (int i = 0; i < BM; ++i) {
          for (int j = 0; j < BN; ++j) {
            const int64_t off = tile::gemm_out_offset(g, grp, m0 + i, p0 + j);
            if (off < 0) continue;
            op[off] = c[i][j];
            ++writes[off];
          }
        }
      }
    }
  }
  expect_each_output_once(writes, out, ref);
}

TEST_P(ConvTiles, BackwardElementsMatchAten) {
  const Case& k = GetParam();
  auto [gx_ref, gw_ref, gb_ref] =
      at::convolution_backward(go, x, wt, std::nullopt, {k.sh, k.sw}, {k.ph, k.pw}, {k.dh, k.dw},
                               false, {0, 0}, k.groups, {true, true, false});
  at::Tensor gx = at::empty_like(x), gw = at::empty_like(wt);
  const double *gop = go.data_ptr<double>(), *xp = x.data_ptr<double>(),
               *wp = wt.data_ptr<double>();
  double* gxp = gx.data_ptr<double>();
  for (int64_t nn = 0; nn < g.n; ++nn)
    for (int64_t c = 0; c < g.c; ++c)
      for (int64_t y = 0; y < g.h; ++y)
        for (int64_t xx = 0; xx < g.w; ++xx)
          gxp[((nn * g.c + c) * g.h + y) * g.w + xx] =
              tile::grad_input_element<double, double>(g, gop, wp, nn, c, y, xx);
  EXPECT_TRUE(at::allclose(gx, gx_ref, 1e-10, 1e-10));
  // grad_weight as grad_weight_runs_kernel and grad_weight_sum_kernel do it:
  // block (split, tap) sums its run over every thread, then the runs in
  // order; thread counts that are and are not multiples of a row's width.
  double* gwp = gw.data_ptr<double>();
  const int64_t taps = gw.numel(), rows = g.n * g.oh;
  for (int64_t target : {int64_t{1}, int64_t{5}, 3 * taps, 1000 * taps}) {
    const int64_t splits = tile::grad_weight_splits(g, target);
    ASSERT_GE(splits, 1);
    ASSERT_LE(splits, std::max<int64_t>(rows, 1));
    std::vector<int> covered(rows, 0);
    for (int64_t sp = 0; sp < splits; ++sp) {
      int64_t begin, end;
      tile::grad_weight_run(g, sp, splits, &begin, &end);
      for (int64_t r = begin; r < end; ++r) ++covered[r];
    }
    for (int64_t r = 0; r < rows; ++r) ASSERT_EQ(covered[r], 1) << "row " << r;
    for (int nthreads : {32, 96, 256}) {
      gw.fill_(std::numeric_limits<double>::quiet_NaN());
      for (int64_t tap = 0; tap < taps; ++tap) {
        double sum = 0;
        for (int64_t sp = 0; sp < splits; ++sp) {
          int64_t begin, end;
          tile::grad_weight_run(g, sp, splits, &begin, &end);
          double part = 0;
          for (int tid = 0; tid < nthreads; ++tid) {
            part += tile::grad_weight_rows<double, double>(g, gop, xp, tap, begin, end, tid,
                                                           nthreads);
          }
          sum += part;
        }
        gwp[tap] = sum;
      }
      EXPECT_TRUE(at::allclose(gw, gw_ref, 1e-10, 1e-10))
          << "splits " << splits << ", threads " << nthreads << ": "
          << (gw - gw_ref).abs().max().item<double>();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ConvTiles,
    ::testing::Values(
        // n, c, h, w, cout, kh, kw, sh, sw, ph, pw, dh, dw, groups
        Case{1, 1, 17, 19, 1, 3, 3, 1, 1, 1, 1, 1, 1, 1},   // the seed's case, odd sizes
        Case{2, 1, 97, 17, 2, 5, 5, 1, 1, 2, 2, 1, 1, 1},   // tall image, several tiles
        Case{1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1},     // single pixel
        Case{1, 1, 1, 1, 1, 3, 3, 1, 1, 1, 1, 1, 1, 1},     // all halo, one output
        Case{2, 3, 17, 13, 4, 7, 5, 2, 3, 3, 2, 2, 1, 1},   // strided, dilated, padded
        Case{1, 2, 20, 23, 2, 3, 3, 3, 3, 0, 3, 3, 2, 1},   // stride 3, dilation 3
        Case{2, 4, 18, 17, 8, 3, 3, 1, 2, 1, 1, 2, 2, 4},   // depthwise x2 multiplier
        Case{1, 6, 12, 13, 4, 3, 2, 1, 1, 2, 0, 3, 1, 2},   // grouped
        Case{2, 20, 9, 11, 70, 3, 3, 1, 1, 1, 1, 1, 1, 1},  // GEMM-sized channels
        Case{1, 12, 7, 6, 18, 2, 3, 2, 1, 1, 3, 1, 2, 3}),  // grouped GEMM, ragged tiles
    [](const ::testing::TestParamInfo<Case>& info) { return name(info.param); });

TEST(ConvTilesDecisions, FilterFitsConstantMemory) {
  EXPECT_TRUE(tile::filter_fits_constant(1 * 1 * 3 * 3, sizeof(float)));   // the seed's 3x3
  EXPECT_TRUE(tile::filter_fits_constant(64 * 1 * 3 * 3, sizeof(float)));  // depthwise 3x3
  EXPECT_TRUE(tile::filter_fits_constant(tile::kConstFilterBytes / 4, sizeof(float)));
  EXPECT_FALSE(tile::filter_fits_constant(tile::kConstFilterBytes / 4 + 1, sizeof(float)));
  EXPECT_FALSE(tile::filter_fits_constant(tile::kConstFilterBytes / 4, sizeof(double)));
  EXPECT_FALSE(tile::filter_fits_constant(256 * 256 * 3 * 3, sizeof(float)));  // ResNet layer
}

TEST(ConvTilesDecisions, DirectPathCanImplement) {
  const int64_t smem = 48 * 1024;
  const ConvGeom seed = geom(Case{1, 1, 2048, 2048, 1, 5, 5, 1, 1, 2, 2, 1, 1, 1});
  EXPECT_TRUE(tile::direct_can_implement(seed, 16, 16, sizeof(float), smem));
  // 16x16 tile, 5x5 filter: a 20x20 patch.
  EXPECT_EQ(tile::patch_h(seed, 16), 20);
  EXPECT_EQ(tile::direct_smem_bytes(seed, 16, 16, sizeof(float), true), 20 * 20 * 4);
  const ConvGeom resnet = geom(Case{8, 64, 56, 56, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1});
  EXPECT_FALSE(tile::direct_can_implement(resnet, 16, 16, sizeof(float), smem));
  // A huge dilation makes the patch outgrow shared memory: GEMM path instead.
  const ConvGeom dilated = geom(Case{1, 1, 2000, 2000, 1, 7, 7, 1, 1, 0, 0, 300, 300, 1});
  EXPECT_FALSE(tile::direct_can_implement(dilated, 16, 16, sizeof(float), smem));
}

}  // namespace
