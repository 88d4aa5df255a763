// The small-filter CUDA conv kernels (kernels/cuda/conv_small_kernel.cu) on
// the CPU: every block and thread of each launch emulated in turn with the
// functions the kernels call (conv_tile_small.h, conv_tile_nhwc.h), phase by
// phase between the kernels' __syncthreads(), against ATen in double
// (tolerance 1e-10: only the summation order differs). Forward, input
// gradient (as a forward and as a gather) and weight gradient (partial sums
// and their ordered sum), NCHW and channels_last depthwise, K = 3/5/7 at
// stride 1 and 2. Each output and each partial sum is written exactly once.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <limits>
#include <vector>

#include "conv_tiles_test_util.h"
#include "kernels/common/conv_tile_nhwc.h"
#include "kernels/common/conv_tile_small.h"

namespace {

using namespace ddpx_test;  // NOLINT(build/namespaces): the shared case table
namespace tile = ddpx::detail::tile;
using tile::NhwcTile;
using tile::SmallTile;

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr int R = SmallTile::kRows;

at::Tensor grad_ref(const Case& c, const at::Tensor& go, const at::Tensor& x, const at::Tensor& wt,
                    int which) {
  std::array<bool, 3> mask{which == 0, which == 1, false};
  const auto grads = at::convolution_backward(go, x, wt, std::nullopt, {c.sh, c.sw}, {c.ph, c.pw},
                                              {c.dh, c.dw}, false, {0, 0}, c.groups, mask);
  return which == 0 ? std::get<0>(grads) : std::get<1>(grads);
}

// Each block's threads over a SmallTile: fn(tx, ty).
template <typename Fn>
void each_small_thread(Fn&& fn) {
  for (int ty = 0; ty < SmallTile::kThreadsY; ++ty) {
    for (int tx = 0; tx < SmallTile::kThreadsX; ++tx) fn(tx, ty);
  }
}

// Each block of an NCHW SmallTile launch over `planes` planes of rows x cols
// outputs (or inputs): fn(plane, by, bx).
template <typename Fn>
void each_small_block(int64_t planes, int64_t rows, int64_t cols, Fn&& fn) {
  for (int64_t plane = 0; plane < planes; ++plane) {
    for (int64_t by = 0; by < tile::ceil_div(rows, SmallTile::kTileH); ++by) {
      for (int64_t bx = 0; bx < tile::ceil_div(cols, SmallTile::kTileW); ++bx) fn(plane, by, bx);
    }
  }
}

// ---- NCHW ---------------------------------------------------------------------------------

// small_fwd_kernel on (x, wt) with geometry g (flip: the taps rotated).
template <int K, int S>
void small_forward(const ConvGeom& g, const at::Tensor& x, const at::Tensor& wt, bool flip,
                   const at::Tensor& ref) {
  using Patch = tile::SmallPatch<K, S>;
  const double* xp = x.data_ptr<double>();
  const double* wp = wt.data_ptr<double>();
  at::Tensor out = at::zeros_like(ref);
  std::vector<int> writes(out.numel(), 0);
  double* op = out.data_ptr<double>();
  std::vector<double> store(Patch::kH * Patch::kW);
  auto* patch = reinterpret_cast<double(*)[Patch::kW]>(store.data());
  each_small_block(g.n * g.cout, g.oh, g.ow, [&](int64_t plane, int64_t by, int64_t bx) {
    const int64_t nn = plane / g.cout, oc = plane % g.cout, grp = oc / g.cog;
    std::vector<std::array<double, R>> acc(SmallTile::kThreads);
    for (auto& a : acc) a.fill(0.0);
    const int64_t iy0 = tile::small_origin_y(g, by), ix0 = tile::small_origin_x(g, bx);
    for (int64_t icg = 0; icg < g.cig; ++icg) {
      std::fill(store.begin(), store.end(), kNan);
      const double* src = xp + (nn * g.c + grp * g.cig + icg) * g.h * g.w;
      each_small_thread([&](int tx, int ty) {
        tile::small_load_patch<K, S>(src, g.h, g.w, iy0, ix0, patch, tx, ty);
      });
      ASSERT_NO_FATAL_FAILURE(expect_patch(g, src, iy0, ix0, Patch::kH, Patch::kW, store.data()));
      double wk[K][K];
      tile::small_load_taps<K>(wp + (oc * g.cig + icg) * K * K, flip, wk);
      each_small_thread([&](int tx, int ty) {
        double a[R];
        std::copy(acc[ty * SmallTile::kThreadsX + tx].begin(),
                  acc[ty * SmallTile::kThreadsX + tx].end(), a);
        tile::small_strip_dot<K, S>(patch, wk, tx, ty, a);
        std::copy(a, a + R, acc[ty * SmallTile::kThreadsX + tx].begin());
      });
    }
    each_small_thread([&](int tx, int ty) {
      for (int r = 0; r < R; ++r) {
        int64_t oy, ox;
        if (!tile::small_output(g, by, bx, tx, ty, r, &oy, &ox)) continue;
        const int64_t off = (plane * g.oh + oy) * g.ow + ox;
        op[off] = acc[ty * SmallTile::kThreadsX + tx][r];
        ++writes[off];
      }
    });
  });
  expect_each_output_once(writes, out, ref);
}

// small_transposed_kernel: grad_input gathered from grad_output.
template <int K, int S>
void small_transposed(const ConvGeom& g, const at::Tensor& go, const at::Tensor& wt,
                      const at::Tensor& ref) {
  at::Tensor gx = at::zeros_like(ref);
  std::vector<int> writes(gx.numel(), 0);
  const double* gp = go.data_ptr<double>();
  each_small_block(g.n * g.c, g.h, g.w, [&](int64_t plane, int64_t by, int64_t bx) {
    const int64_t nn = plane / g.c, c = plane % g.c, grp = c / g.cig, icg = c % g.cig;
    each_small_thread([&](int tx, int ty) {
      int64_t iy0, ix;
      if (!tile::transposed_input(g, by, bx, tx, ty, &iy0, &ix)) return;
      double acc[R] = {};
      for (int64_t m = 0; m < g.cog; ++m) {
        const int64_t oc = grp * g.cog + m;
        double wk[K][K];
        tile::small_load_taps<K>(wt.data_ptr<double>() + (oc * g.cig + icg) * K * K, false, wk);
        tile::transposed_strip<K, S, R>(gp + (nn * g.cout + oc) * g.oh * g.ow, g.oh, g.ow, g.ow, 1,
                                        g.ph, g.pw, iy0, ix, wk, acc);
      }
      for (int r = 0; r < R; ++r) {
        if (iy0 + r >= g.h) continue;
        const int64_t off = (plane * g.h + iy0 + r) * g.w + ix;
        gx.data_ptr<double>()[off] = acc[r];
        ++writes[off];
      }
    });
  });
  expect_each_output_once(writes, gx, ref);
}

// The sum pass (launch_sum): a tap's partial sums added in order by one
// thread, or, from kBlockSumSplits on, as a block's 256 strided shares.
void sum_partials(const std::vector<double>& partial, int64_t splits, at::Tensor& gw) {
  for (int64_t tap = 0; tap < gw.numel(); ++tap) {
    const double* mine = partial.data() + tap * splits;
    double s = 0;
    if (splits < tile::kBlockSumSplits) {  // sum_partials_serial_kernel
      for (int64_t k = 0; k < splits; ++k) s += mine[k];
    } else {
      for (int tid = 0; tid < 256; ++tid) s += tile::partial_share(mine, splits, tid, 256);
    }
    gw.data_ptr<double>()[tap] = s;
  }
}

// small_grad_weight_kernel with `images` images a block, then the sum pass.
template <int K, int S>
void small_grad_weight(const ConvGeom& g, const at::Tensor& go, const at::Tensor& x,
                       int64_t images, const at::Tensor& ref) {
  using Patch = tile::SmallPatch<K, S>;
  const int64_t splits = tile::small_grad_weight_splits(g, images);
  std::vector<double> partial(ref.numel() * splits, kNan);
  std::vector<int> writes(partial.size(), 0);
  std::vector<double> store(Patch::kH * Patch::kW);
  auto* patch = reinterpret_cast<double(*)[Patch::kW]>(store.data());
  const int64_t items = tile::ceil_div(g.n, images) * g.cout;
  each_small_block(items, g.oh, g.ow, [&](int64_t item, int64_t by, int64_t bx) {
    const int64_t ng = item / g.cout, oc = item % g.cout, grp = oc / g.cog;
    const int64_t n1 = std::min((ng + 1) * images, g.n);
    const int64_t slot = tile::small_grad_weight_slot(g, ng, by, bx);
    const int64_t iy0 = tile::small_origin_y(g, by), ix0 = tile::small_origin_x(g, bx);
    for (int64_t icg = 0; icg < g.cig; ++icg) {
      // Each thread's sums over the block's images, in registers.
      std::vector<std::array<double, K * K>> mine(SmallTile::kThreads, std::array<double, K * K>{});
      for (int64_t nn = ng * images; nn < n1; ++nn) {
        std::fill(store.begin(), store.end(), kNan);
        each_small_thread([&](int tx, int ty) {
          tile::small_load_patch<K, S>(
              x.data_ptr<double>() + (nn * g.c + grp * g.cig + icg) * g.h * g.w, g.h, g.w, iy0,
              ix0, patch, tx, ty);
        });
        each_small_thread([&](int tx, int ty) {
          double gv[R];
          tile::small_load_grad_out(g, go.data_ptr<double>() + (nn * g.cout + oc) * g.oh * g.ow,
                                    by, bx, tx, ty, gv);
          double gw[K][K];
          auto& acc = mine[ty * SmallTile::kThreadsX + tx];
          for (int t = 0; t < K * K; ++t) gw[t / K][t % K] = acc[t];
          tile::strip_grad_weight<K, S, R>(tile::PatchRows<K, S, double>(patch, tx, ty), gv, gw);
          for (int t = 0; t < K * K; ++t) acc[t] = gw[t / K][t % K];
        });
      }
      double block[K][K] = {};
      for (const auto& acc : mine) {
        for (int t = 0; t < K * K; ++t) block[t / K][t % K] += acc[t];
      }
      for (int t = 0; t < K * K; ++t) {
        const int64_t at = ((oc * g.cig + icg) * K * K + t) * splits + slot;
        partial[at] = block[t / K][t % K];
        ++writes[at];
      }
    }
  });
  for (size_t i = 0; i < writes.size(); ++i) ASSERT_EQ(writes[i], 1) << "partial " << i;
  at::Tensor gw = at::zeros_like(ref);
  sum_partials(partial, splits, gw);
  EXPECT_TRUE(at::allclose(gw, ref, 1e-10, 1e-10)) << (gw - ref).abs().max().item<double>();
}

class ConvTilesSmall : public ConvCaseTest {};

TEST_P(ConvTilesSmall, Forward) {
  const tile::SmallFilter f = tile::small_direct(g);
  ASSERT_TRUE(f) << "not a small-filter case";
  tile::with_small(f, [&](auto k, auto s) {
    small_forward<decltype(k)::value, decltype(s)::value>(g, x, wt, false, ref);
  });
}

// grad_input as the small-filter forward over grad_output (stride 1: the
// flipped, channel-swapped filter, or the filter read flipped when each group
// has one channel each way), else gathered.
TEST_P(ConvTilesSmall, GradInput) {
  const Case& c = GetParam();
  const at::Tensor gx_ref = grad_ref(c, go, x, wt, 0);
  if (const tile::SmallFilter f = tile::small_grad_input(g)) {
    const ConvGeom t = tile::grad_input_as_forward(g);
    const bool flip_only = g.cig == 1 && g.cog == 1;
    const at::Tensor filt = flip_only ? wt : tile::grad_input_filter(wt, c.groups);
    tile::with_small(f, [&](auto k, auto s) {
      small_forward<decltype(k)::value, decltype(s)::value>(t, go, filt, flip_only, gx_ref);
    });
  }
  const tile::SmallFilter f = tile::small_transposed(g);
  ASSERT_TRUE(f) << "no small-filter input gradient";
  tile::with_small(f, [&](auto k, auto s) {
    small_transposed<decltype(k)::value, decltype(s)::value>(g, go, wt, gx_ref);
  });
}

TEST_P(ConvTilesSmall, GradWeight) {
  const tile::SmallFilter f = tile::small_direct(g);
  ASSERT_TRUE(f);
  const at::Tensor gw_ref = grad_ref(GetParam(), go, x, wt, 1);
  // As the launch picks them (few blocks: several images a block, 3x3 at
  // stride 1), and one, two, the whole batch where the kernel sums several.
  std::vector<int64_t> each{tile::small_grad_weight_images(g, 8)};
  if (tile::small_grad_weight_batches(static_cast<int>(g.kh), static_cast<int>(g.sh))) {
    each.insert(each.end(), {1, 2, g.n});
  }
  for (const int64_t images : each) {
    SCOPED_TRACE(images);
    tile::with_small(f, [&](auto k, auto s) {
      small_grad_weight<decltype(k)::value, decltype(s)::value>(g, go, x, images, gw_ref);
    });
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ConvTilesSmall,
    ::testing::Values(
        // n, c, h, w, cout, kh, kw, sh, sw, ph, pw, dh, dw, groups
        Case{1, 1, 17, 19, 1, 3, 3, 1, 1, 1, 1, 1, 1, 1},  // the seed's case, odd sizes
        Case{2, 1, 97, 70, 2, 5, 5, 1, 1, 2, 2, 1, 1, 1},  // several tiles both ways, ragged
        Case{1, 1, 1, 1, 1, 3, 3, 1, 1, 1, 1, 1, 1, 1},    // all halo, one output
        Case{1, 1, 5, 5, 1, 5, 5, 1, 1, 0, 0, 1, 1, 1},    // no padding: one output
        Case{2, 3, 33, 65, 3, 3, 3, 1, 1, 0, 2, 1, 1, 3},  // depthwise, padding 0 / 2
        Case{1, 8, 40, 31, 8, 5, 5, 1, 1, 4, 1, 1, 1, 2},  // 4 channels per group, pad > k/2
        Case{3, 2, 9, 34, 4, 3, 3, 1, 1, 1, 0, 1, 1, 1},   // 2 channels, 2 filters
        Case{2, 4, 45, 37, 4, 7, 7, 1, 1, 3, 3, 1, 1, 4},  // depthwise 7x7
        Case{2, 3, 70, 67, 3, 3, 3, 2, 2, 1, 1, 1, 1, 3},  // depthwise stride 2, odd
        Case{1, 2, 69, 66, 2, 5, 5, 2, 2, 2, 2, 1, 1, 2},  // 5x5 stride 2, two tiles down
        Case{2, 2, 41, 80, 2, 7, 7, 2, 2, 3, 3, 1, 1, 2},  // 7x7 stride 2, two tiles across
        Case{1, 2, 23, 29, 4, 7, 7, 2, 2, 7, 1, 1, 1, 2},  // multiplier 2, pad > K-1
        Case{1, 1, 7, 7, 1, 7, 7, 2, 2, 0, 0, 1, 1, 1}),   // stride 2, one output
    [](const ::testing::TestParamInfo<Case>& info) { return name(info.param); });

// ---- channels_last depthwise ------------------------------------------------------------------

// Each block of an NHWC launch: fn(bc, bx, bz) over grid (x, y, z).
template <typename Fn>
void each_block(int64_t gx, int64_t gy, int64_t gz, Fn&& fn) {
  for (int64_t bc = 0; bc < gx; ++bc) {
    for (int64_t bx = 0; bx < gy; ++bx) {
      for (int64_t bz = 0; bz < gz; ++bz) fn(bc, bx, bz);
    }
  }
}

std::vector<double> staged_taps(const ConvGeom& g, const double* wt, int64_t kk, int64_t bc) {
  std::vector<double> staged(NhwcTile::kThreadsC * kk, kNan);
  for (int tid = 0; tid < NhwcTile::kThreads; ++tid)
    tile::nhwc_stage_taps(wt, g.c, kk, bc, staged.data(), tid);
  return staged;
}

// nhwc_fwd_kernel (flip: the input gradient as a forward), or with
// `transposed` nhwc_transposed_kernel, over grid z `gz` (blocks stride over
// the strips); ref is the result in logical NCHW.
template <int K, int S>
void nhwc_pass(const ConvGeom& g, const at::Tensor& in_cl, const at::Tensor& wt, bool flip,
               bool transposed, int64_t gz, const at::Tensor& ref) {
  const int64_t rows = transposed ? g.h : g.oh, cols = transposed ? g.w : g.ow;
  at::Tensor out = at::zeros({g.n, rows, cols, g.c}, ref.options());  // NHWC memory
  std::vector<int> writes(out.numel(), 0);
  const double* in = in_cl.data_ptr<double>();
  each_block(tile::ceil_div(g.c, NhwcTile::kThreadsC), tile::ceil_div(cols, NhwcTile::kThreadsX),
             gz, [&](int64_t bc, int64_t bx, int64_t bz) {
               const std::vector<double> staged = staged_taps(g, wt.data_ptr<double>(), K * K, bc);
               for (int ty = 0; ty < NhwcTile::kThreadsX; ++ty) {
                 for (int tx = 0; tx < NhwcTile::kThreadsC; ++tx) {
                   int64_t ch, col;
                   if (!tile::nhwc_thread(g.c, cols, bc, bx, tx, ty, &ch, &col)) continue;
                   double wk[K][K];
                   tile::nhwc_taps<K>(staged.data(), tx, flip, wk);
                   for (int64_t z = bz; z < tile::nhwc_strips(g.n, rows); z += gz) {
                     int64_t nn, row0;
                     tile::nhwc_strip(z, rows, &nn, &row0);
                     double acc[NhwcTile::kRows] = {};
                     if (transposed) {
                       tile::transposed_strip<K, S, NhwcTile::kRows>(
                           in + nn * g.oh * g.ow * g.c + ch, g.oh, g.ow, g.ow * g.c, g.c, g.ph,
                           g.pw, row0, col, wk, acc);
                     } else {
                       tile::strip_dot<K, S, NhwcTile::kRows>(
                           tile::nhwc_rows<double, double>(g, in, nn, ch, row0, col), wk, acc);
                     }
                     for (int r = 0; r < NhwcTile::kRows; ++r) {
                       if (row0 + r >= rows) continue;
                       const int64_t off =
                           tile::nhwc_offset(rows, cols, g.c, nn, row0 + r, col, ch);
                       out.data_ptr<double>()[off] = acc[r];
                       ++writes[off];
                     }
                   }
                 }
               }
             });
  expect_each_output_once(writes, out, ref.permute({0, 2, 3, 1}));
}

// nhwc_grad_weight_kernel with grid z `gz`, then the sum pass.
template <int K, int S>
void nhwc_grad_weight(const ConvGeom& g, const at::Tensor& go_cl, const at::Tensor& x_cl,
                      int64_t gz, const at::Tensor& ref) {
  const int64_t splits = tile::nhwc_grad_weight_splits(g, gz);
  std::vector<double> partial(ref.numel() * splits, kNan);
  std::vector<int> writes(partial.size(), 0);
  const double* gop = go_cl.data_ptr<double>();
  each_block(
      tile::ceil_div(g.c, NhwcTile::kThreadsC), tile::ceil_div(g.ow, NhwcTile::kThreadsX), gz,
      [&](int64_t bc, int64_t bx, int64_t bz) {
        double red[NhwcTile::kThreadsC][K * K] = {};
        for (int ty = 0; ty < NhwcTile::kThreadsX; ++ty) {  // (the kernel's ty order)
          for (int tx = 0; tx < NhwcTile::kThreadsC; ++tx) {
            int64_t ch, col;
            if (!tile::nhwc_thread(g.c, g.ow, bc, bx, tx, ty, &ch, &col)) continue;
            double gw[K][K] = {};
            for (int64_t z = bz; z < tile::nhwc_strips(g.n, g.oh); z += gz) {
              int64_t nn, row0;
              tile::nhwc_strip(z, g.oh, &nn, &row0);
              double gv[NhwcTile::kRows];
              for (int r = 0; r < NhwcTile::kRows; ++r) {
                gv[r] = row0 + r < g.oh
                            ? gop[tile::nhwc_offset(g.oh, g.ow, g.c, nn, row0 + r, col, ch)]
                            : 0.0;
              }
              tile::strip_grad_weight<K, S, NhwcTile::kRows>(
                  tile::nhwc_rows<double, double>(g, x_cl.data_ptr<double>(), nn, ch, row0, col),
                  gv, gw);
            }
            for (int t = 0; t < K * K; ++t) red[tx][t] += gw[t / K][t % K];
          }
        }
        const int64_t slot = bx * gz + bz;
        for (int e = 0; e < NhwcTile::kThreadsC * K * K; ++e) {
          const int64_t c = bc * NhwcTile::kThreadsC + e / (K * K);
          if (c >= g.c) continue;
          const int64_t at = (c * K * K + e % (K * K)) * splits + slot;
          partial[at] = red[e / (K * K)][e % (K * K)];
          ++writes[at];
        }
      });
  for (size_t i = 0; i < writes.size(); ++i) ASSERT_EQ(writes[i], 1) << "partial " << i;
  at::Tensor gw = at::zeros_like(ref);
  sum_partials(partial, splits, gw);
  EXPECT_TRUE(at::allclose(gw, ref, 1e-10, 1e-10)) << (gw - ref).abs().max().item<double>();
}

class ConvTilesNhwc : public ConvTilesSmall {
 protected:
  // A grid z that makes blocks stride over several strips.
  int64_t small_z(int64_t rows) const {
    return std::min<int64_t>(tile::nhwc_grid_z(tile::nhwc_strips(g.n, rows)), 3);
  }
};

TEST_P(ConvTilesNhwc, ForwardAndGradInput) {
  const Case& c = GetParam();
  const tile::SmallFilter f = tile::nhwc_depthwise(g);
  ASSERT_TRUE(f) << "not a channels_last depthwise case";
  const at::Tensor x_cl = x.contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor go_cl = go.contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor gx_ref = grad_ref(c, go, x, wt, 0);
  tile::with_small(f, [&](auto k, auto s) {
    constexpr int K = decltype(k)::value, S = decltype(s)::value;
    nhwc_pass<K, S>(g, x_cl, wt, false, false, small_z(g.oh), ref);
    nhwc_pass<K, S>(g, x_cl, wt, false, false, tile::nhwc_grid_z(tile::nhwc_strips(g.n, g.oh)),
                    ref);
    if (tile::small_grad_input(g)) {
      nhwc_pass<K, S>(tile::grad_input_as_forward(g), go_cl, wt, true, false, small_z(g.h), gx_ref);
    }
    nhwc_pass<K, S>(g, go_cl, wt, false, true, small_z(g.h), gx_ref);
  });
}

TEST_P(ConvTilesNhwc, GradWeight) {
  const tile::SmallFilter f = tile::nhwc_depthwise(g);
  ASSERT_TRUE(f);
  const at::Tensor gw_ref = grad_ref(GetParam(), go, x, wt, 1);
  const at::Tensor x_cl = x.contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor go_cl = go.contiguous(at::MemoryFormat::ChannelsLast);
  tile::with_small(f, [&](auto k, auto s) {
    constexpr int K = decltype(k)::value, S = decltype(s)::value;
    // Few blocks (many strips each) and the launch's own count.
    nhwc_grad_weight<K, S>(g, go_cl, x_cl, tile::nhwc_grad_weight_grid_z(g, 2), gw_ref);
    nhwc_grad_weight<K, S>(g, go_cl, x_cl, tile::nhwc_grad_weight_grid_z(g, 8 * 132), gw_ref);
  });
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ConvTilesNhwc,
    ::testing::Values(
        // n, c, h, w, cout, kh, kw, sh, sw, ph, pw, dh, dw, groups
        Case{2, 5, 13, 11, 5, 3, 3, 1, 1, 1, 1, 1, 1, 5},    // fewer channels than a warp
        Case{1, 33, 9, 17, 33, 3, 3, 2, 2, 1, 1, 1, 1, 33},  // two channel blocks, stride 2
        Case{2, 8, 14, 15, 8, 5, 5, 1, 1, 2, 0, 1, 1, 8},    // 5x5, padding 2 / 0
        Case{1, 6, 17, 12, 6, 7, 7, 2, 2, 3, 3, 1, 1, 6},    // 7x7 stride 2
        Case{1, 4, 12, 10, 4, 7, 7, 1, 1, 3, 3, 1, 1, 4},    // 7x7 stride 1
        Case{2, 3, 6, 9, 3, 3, 3, 1, 1, 3, 2, 1, 1, 3},      // padding over K-1: gather only
        Case{1, 2, 1, 1, 2, 5, 5, 2, 2, 2, 2, 1, 1, 2}),     // one pixel
    [](const ::testing::TestParamInfo<Case>& info) { return name(info.param); });

// Both forms of the sum pass add every partial sum exactly once (the kernel
// emulations above have few partials per tap: the serial form).
TEST(ConvTilesDecisions, SumPassBothForms) {
  for (const int64_t splits :
       {int64_t{1}, int64_t{7}, tile::kBlockSumSplits - 1, tile::kBlockSumSplits, int64_t{1000}}) {
    const at::Tensor parts = at::randn({3, splits}, at::kDouble);
    const std::vector<double> flat(parts.data_ptr<double>(),
                                   parts.data_ptr<double>() + parts.numel());
    at::Tensor gw = at::zeros({3}, at::kDouble);
    sum_partials(flat, splits, gw);
    EXPECT_TRUE(at::allclose(gw, parts.sum(1), 1e-12, 1e-12)) << splits;
  }
}

TEST(ConvTilesDecisions, SmallFilterPath) {
  EXPECT_EQ(tile::small_direct(geom(Case{1, 1, 2048, 2048, 1, 5, 5, 1, 1, 2, 2, 1, 1, 1})).k, 5);
  EXPECT_EQ(tile::small_direct(geom(Case{8, 32, 56, 56, 32, 3, 3, 1, 1, 1, 1, 1, 1, 32})).k, 3);
  const tile::SmallFilter s2 =
      tile::small_direct(geom(Case{8, 32, 56, 56, 32, 7, 7, 2, 2, 3, 3, 1, 1, 32}));
  EXPECT_EQ(s2.k, 7);
  EXPECT_EQ(s2.s, 2);
  // grad_input as a forward: stride 1 and a padding K-1-p that is not negative.
  EXPECT_TRUE(tile::small_grad_input(geom(Case{1, 1, 64, 64, 1, 3, 3, 1, 1, 2, 2, 1, 1, 1})));
  EXPECT_FALSE(tile::small_grad_input(geom(Case{1, 1, 64, 64, 1, 3, 3, 1, 1, 3, 1, 1, 1, 1})));
  EXPECT_FALSE(tile::small_grad_input(geom(Case{1, 1, 64, 64, 1, 3, 3, 2, 2, 1, 1, 1, 1, 1})));
  EXPECT_TRUE(tile::small_transposed(geom(Case{1, 1, 64, 64, 1, 3, 3, 2, 2, 1, 1, 1, 1, 1})));
  // Not small-filter: stride 3 or mixed, dilated, other or non-square filters, many channels.
  EXPECT_FALSE(tile::small_direct(geom(Case{1, 1, 64, 64, 1, 3, 3, 3, 3, 1, 1, 1, 1, 1})));
  EXPECT_FALSE(tile::small_direct(geom(Case{1, 1, 64, 64, 1, 3, 3, 1, 2, 1, 1, 1, 1, 1})));
  EXPECT_FALSE(tile::small_direct(geom(Case{1, 1, 64, 64, 1, 3, 3, 1, 1, 2, 2, 2, 2, 1})));
  EXPECT_FALSE(tile::small_direct(geom(Case{1, 1, 64, 64, 1, 9, 9, 1, 1, 4, 4, 1, 1, 1})));
  EXPECT_FALSE(tile::small_direct(geom(Case{1, 1, 64, 64, 1, 3, 5, 1, 1, 1, 2, 1, 1, 1})));
  EXPECT_FALSE(tile::small_direct(geom(Case{8, 64, 56, 56, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1})));
  EXPECT_FALSE(tile::small_transposed(geom(Case{8, 8, 56, 56, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1})));
  // channels_last: depthwise with one filter per channel only.
  EXPECT_TRUE(tile::nhwc_depthwise(geom(Case{8, 32, 56, 56, 32, 7, 7, 2, 2, 3, 3, 1, 1, 32})));
  EXPECT_FALSE(tile::nhwc_depthwise(geom(Case{8, 32, 56, 56, 64, 3, 3, 1, 1, 1, 1, 1, 1, 32})));
  EXPECT_FALSE(tile::nhwc_depthwise(geom(Case{8, 32, 56, 56, 32, 3, 3, 1, 1, 1, 1, 1, 1, 16})));
  // The share of a grid's threads with an output: 56x56 in four 32x32 tiles;
  // 7x7 in one; stride 2 counts the output plane; an empty plane none.
  const auto fill = [&](int64_t hw, int64_t s) {
    return tile::small_tile_fill(geom(Case{8, 32, hw, hw, 32, 3, 3, s, s, 1, 1, 1, 1, 32}));
  };
  EXPECT_DOUBLE_EQ(fill(56, 1), 56.0 * 56 / (64 * 64));
  EXPECT_DOUBLE_EQ(fill(7, 1), 49.0 / 1024);
  EXPECT_DOUBLE_EQ(fill(112, 2), 56.0 * 56 / (64 * 64));
  EXPECT_DOUBLE_EQ(fill(64, 1), 1.0);
  EXPECT_EQ(tile::small_tile_fill(geom(Case{1, 1, 2, 2, 1, 3, 3, 1, 1, 0, 0, 1, 1, 1})), 0.0);
  // The seed's weight gradient on the forward's blocks: one partial per 32x32 tile.
  const ConvGeom seed3 = geom(Case{1, 1, 2048, 2048, 1, 3, 3, 1, 1, 1, 1, 1, 1, 1});
  EXPECT_EQ(tile::small_grad_weight_images(seed3, 8 * 132), 1);
  EXPECT_EQ(tile::small_grad_weight_splits(seed3, 1), 4096);
  // Depthwise 3x3 c64 at 56x56, batch 8: 2048 blocks at an image each; two
  // images a block (1024 blocks) come nearest 8 per SM of an H200.
  const ConvGeom dw3 = geom(Case{8, 64, 56, 56, 64, 3, 3, 1, 1, 1, 1, 1, 1, 64});
  EXPECT_EQ(tile::small_grad_weight_images(dw3, 8 * 132), 2);
  EXPECT_EQ(tile::small_grad_weight_splits(dw3, 2), 4 * 4);
  EXPECT_EQ(tile::small_grad_weight_images(dw3, 1), 8);  // (never more than the batch)
  EXPECT_EQ(tile::small_grad_weight_images(dw3, 0), 8);
  EXPECT_EQ(tile::small_grad_weight_images(dw3, 1 << 20), 1);
  // Not 3x3 at stride 1: an image a block (small_grad_weight_batches).
  EXPECT_EQ(tile::small_grad_weight_images(
                geom(Case{8, 96, 56, 56, 96, 7, 7, 1, 1, 3, 3, 1, 1, 96}), 8 * 132), 1);
  EXPECT_EQ(tile::small_grad_weight_images(
                geom(Case{8, 96, 112, 112, 96, 3, 3, 2, 2, 1, 1, 1, 1, 96}), 8), 1);
  // Row runs (other geometries): never more runs than rows, never fewer than one.
  const ConvGeom seed = geom(Case{1, 1, 2048, 2048, 1, 5, 5, 1, 1, 2, 2, 1, 1, 1});
  EXPECT_EQ(tile::grad_weight_splits(seed, 1056), 43);
  EXPECT_EQ(tile::grad_weight_splits(geom(Case{1, 1, 3, 3, 1, 3, 3, 1, 1, 1, 1, 1, 1, 1}), 1056),
            3);
  EXPECT_EQ(
      tile::grad_weight_splits(geom(Case{8, 64, 56, 56, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1}), 1056), 1);
}

}  // namespace
