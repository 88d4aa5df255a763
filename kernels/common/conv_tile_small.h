#pragma once
// The CUDA tiled_conv2d kernels' fast paths, as __host__ __device__ functions
// (kernels/cuda/tiled_conv2d_kernel.cu launches them; tests/cpp/
// test_conv_tiles.cpp emulates every block and thread with them on the CPU).
//
// Why: on an H200 the general direct kernel (conv_tile.h) ran the seed's
// single-channel 5x5 forward on a 2048x2048 image in 126 us, 16x the
// memory-bandwidth floor (bench_results/gpu/2026-11-28-h200): per output it
// ran a run-time kh x kw loop with 64-bit index math and a 64-bit division per
// loaded element (by our count of the source, several hundred instructions
// for 25 multiply-adds; not profiled). Its weight gradient gave each filter
// tap one block, so the seed's 25 taps used 25 of 132 SMs for 4M pixels each;
// that case's backward took 12.9 ms.
//
// Small square filters (K = 3 or 5, stride 1, dilation 1, at most 4 input
// channels per group: the seed, depthwise 3x3/5x5): K is a template
// argument, so the taps sit in registers and every loop unrolls; a block of
// kThreadsX x kThreadsY threads owns a kTileH x kTileW output tile and each
// thread kRows consecutive outputs of one column, so each input row it loads
// from shared memory serves up to K of its outputs; in-tile indices are 32-bit.
//
// Input gradient (same filters): that forward over grad_output with the
// filter flipped (grad_input_as_forward).
//
// Weight gradient: the n*oh output rows of each tap are cut into `splits`
// runs, one block each; a second pass adds each tap's partial sums in a fixed
// order (deterministic, no atomics).
#include <ATen/ATen.h>

#include <cstdint>

#include "kernels/common/conv_tile.h"
#include "kernels/common/host_device.h"

#if defined(__CUDACC__)
#define DDPX_UNROLL _Pragma("unroll")
#else
#define DDPX_UNROLL
#endif

namespace ddpx::detail::tile {

struct SmallTile {
  static constexpr int kThreadsX = 32, kThreadsY = 8, kRows = 4;
  static constexpr int kTileW = kThreadsX, kTileH = kThreadsY * kRows;
  static constexpr int64_t kMaxGridY = 65535;
};

template <int K>
struct SmallPatch {
  static constexpr int kH = SmallTile::kTileH + K - 1, kW = SmallTile::kTileW + K - 1;
};

// Whether the small-filter forward serves g, and its K (0: it does not).
DDPX_HD int small_direct_k(const ConvGeom& g) {
  const bool plain = g.sh == 1 && g.sw == 1 && g.dh == 1 && g.dw == 1 && g.kh == g.kw;
  if (!plain || (g.kh != 3 && g.kh != 5) || g.cig > 4) return 0;
  if (ceil_div(g.oh, SmallTile::kTileH) > SmallTile::kMaxGridY) return 0;
  return static_cast<int>(g.kh);
}

// Top-left input coordinate of block (by, bx)'s patch (negative in the padding).
DDPX_HD int64_t small_origin_y(const ConvGeom& g, int64_t by) {
  return by * SmallTile::kTileH - g.ph;
}
DDPX_HD int64_t small_origin_x(const ConvGeom& g, int64_t bx) {
  return bx * SmallTile::kTileW - g.pw;
}

// Thread (tx, ty)'s share of a patch load: rows ty, ty + kThreadsY, ...;
// columns tx, tx + kThreadsX, ... (no division); zero in the padding.
template <int K, typename T, typename Acc>
DDPX_HD void small_load_patch(const T* plane, int64_t h, int64_t w, int64_t iy0, int64_t ix0,
                              Acc (*patch)[SmallPatch<K>::kW], int tx, int ty) {
  for (int r = ty; r < SmallPatch<K>::kH; r += SmallTile::kThreadsY) {
    const int64_t iy = iy0 + r;
    const bool row_in = iy >= 0 && iy < h;
    for (int c = tx; c < SmallPatch<K>::kW; c += SmallTile::kThreadsX) {
      const int64_t ix = ix0 + c;
      patch[r][c] = row_in && ix >= 0 && ix < w ? static_cast<Acc>(plane[iy * w + ix]) : Acc(0);
    }
  }
}

// One input channel's K x K taps, into registers (every thread of a block
// reads the same addresses: one broadcast load each).
template <int K, typename T, typename Acc>
DDPX_HD void small_load_taps(const T* taps, Acc (&wk)[K][K]) {
  DDPX_UNROLL
  for (int i = 0; i < K; ++i) {
    DDPX_UNROLL
    for (int j = 0; j < K; ++j) wk[i][j] = static_cast<Acc>(taps[i * K + j]);
  }
}

// Adds one channel's taps to thread (tx, ty)'s kRows outputs (tile rows
// ty*kRows + r, column tx): patch row ty*kRows + rr serves outputs r with
// 0 <= rr - r < K, so kRows + K - 1 row loads instead of kRows * K. Per
// output, taps are added row by row, left to right, as patch_dot does.
template <int K, typename Acc>
DDPX_HD void small_strip_dot(const Acc (*patch)[SmallPatch<K>::kW], const Acc (&wk)[K][K], int tx,
                             int ty, Acc (&acc)[SmallTile::kRows]) {
  constexpr int R = SmallTile::kRows;
  DDPX_UNROLL
  for (int rr = 0; rr < R + K - 1; ++rr) {
    Acc v[K];
    DDPX_UNROLL
    for (int j = 0; j < K; ++j) v[j] = patch[ty * R + rr][tx + j];
    DDPX_UNROLL
    for (int r = 0; r < R; ++r) {
      const int i = rr - r;
      if (i < 0 || i >= K) continue;
      DDPX_UNROLL
      for (int j = 0; j < K; ++j) acc[r] += wk[i][j] * v[j];
    }
  }
}

// Output of thread (tx, ty)'s r-th row in block (by, bx); false past the
// plane's bottom/right edge (the thread still helped loading).
DDPX_HD bool small_output(const ConvGeom& g, int64_t by, int64_t bx, int tx, int ty, int r,
                          int64_t* oy, int64_t* ox) {
  *oy = by * SmallTile::kTileH + ty * SmallTile::kRows + r;
  *ox = bx * SmallTile::kTileW + tx;
  return *oy < g.oh && *ox < g.ow;
}

// ---- input gradient as a small-filter forward ------------------------------------------------

// At stride 1 and dilation 1, grad_input is a forward convolution over
// grad_output (channels cout -> c) with padding K-1-p and the filter flipped,
// its channel axes swapped within each group (grad_input_filter). Its
// geometry:
DDPX_HD ConvGeom grad_input_as_forward(const ConvGeom& g) {
  ConvGeom t = g;
  t.c = g.cout;
  t.h = g.oh;
  t.w = g.ow;
  t.cout = g.c;
  t.oh = g.h;
  t.ow = g.w;
  t.ph = g.kh - 1 - g.ph;
  t.pw = g.kw - 1 - g.pw;
  t.cig = g.cog;
  t.cog = g.cig;
  return t;
}

// K when the small-filter forward computes g's grad_input that way, else 0
// (a padding over K-1 has no such form; the rest as small_direct_k).
DDPX_HD int small_grad_input_k(const ConvGeom& g) {
  if (g.ph > g.kh - 1 || g.pw > g.kw - 1) return 0;
  return small_direct_k(grad_input_as_forward(g));
}

// ---- weight gradient in row runs -----------------------------------------------------------

// How many runs each tap's n*oh rows are cut into: enough blocks for
// `target_blocks` in all, never more runs than rows.
DDPX_HD int64_t grad_weight_splits(const ConvGeom& g, int64_t target_blocks) {
  const int64_t taps = g.cout * g.cig * g.kh * g.kw, rows = g.n * g.oh;
  int64_t s = ceil_div(target_blocks, taps);
  if (s > rows) s = rows;
  return s < 1 ? 1 : s;
}

// Rows [begin, end) of run `split` of `splits`.
DDPX_HD void grad_weight_run(const ConvGeom& g, int64_t split, int64_t splits, int64_t* begin,
                             int64_t* end) {
  const int64_t rows = g.n * g.oh, per = ceil_div(rows, splits);
  *begin = split * per < rows ? split * per : rows;
  *end = *begin + per < rows ? *begin + per : rows;
}

// Thread tid of nthreads' share of tap `tap`'s sum over rows [begin, end):
// threads side by side along a row (a warp's worth of columns at least),
// several rows at once when the rows are narrow.
template <typename T, typename Acc>
DDPX_HD Acc grad_weight_rows(const ConvGeom& g, const T* go, const T* x, int64_t tap, int64_t begin,
                             int64_t end, int tid, int nthreads) {
  const int64_t j = tap % g.kw, i = (tap / g.kw) % g.kh, icg = (tap / (g.kw * g.kh)) % g.cig;
  const int64_t oc = tap / (g.kw * g.kh * g.cig), c = (oc / g.cog) * g.cig + icg;
  int64_t across = ceil_div(g.ow, 32) * 32;
  if (across > nthreads) across = nthreads;
  const int64_t lanes_down = nthreads / across, col0 = tid % across, row0 = tid / across;
  Acc s = 0;
  if (row0 >= lanes_down) return s;  // (nthreads not a multiple of `across`)
  for (int64_t row = begin + row0; row < end; row += lanes_down) {
    const int64_t nn = row / g.oh, oy = row % g.oh;
    const int64_t iy = oy * g.sh - g.ph + i * g.dh;
    if (iy < 0 || iy >= g.h) continue;
    const T* gorow = go + ((nn * g.cout + oc) * g.oh + oy) * g.ow;
    const T* xrow = x + ((nn * g.c + c) * g.h + iy) * g.w;
    for (int64_t ox = col0; ox < g.ow; ox += across) {
      const int64_t ix = ox * g.sw - g.pw + j * g.dw;
      if (ix >= 0 && ix < g.w) s += static_cast<Acc>(gorow[ox]) * static_cast<Acc>(xrow[ix]);
    }
  }
  return s;
}

// grad_input_as_forward's filter: weight [cout, cig, K, K] -> [c, cog, K, K],
// w'[grp*cig + i, m] = flip(w[grp*cog + m, i]). (Host only: ATen ops.)
inline at::Tensor grad_input_filter(const at::Tensor& weight, int64_t groups) {
  const int64_t cout = weight.size(0), cig = weight.size(1), kh = weight.size(2),
                kw = weight.size(3);
  return weight.reshape({groups, cout / groups, cig, kh, kw})
      .transpose(1, 2)
      .flip({3, 4})
      .reshape({groups * cig, cout / groups, kh, kw})
      .contiguous();
}

}  // namespace ddpx::detail::tile
