#pragma once
// The CUDA tiled_conv2d kernels' fast paths, as __host__ __device__ functions
// (kernels/cuda/tiled_conv2d_kernel.cu and conv_small_kernel.cu launch them;
// tests/cpp/test_conv_tiles.cpp and test_conv_tiles_small.cpp emulate every
// block and thread with them on the CPU).
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
// Small square filters (K = 3, 5 or 7, stride S = 1 or 2, dilation 1, at most
// 4 input channels per group: the seed, depthwise): K and S are template
// arguments, so the taps sit in registers and every loop unrolls; a block of
// kThreadsX x kThreadsY threads owns a kTileH x kTileW output tile and each
// thread kRows consecutive outputs of one column, so each input row it loads
// from shared memory serves up to ceil(K / S) of its outputs (a "strip");
// in-tile indices are 32-bit.
//
// Input gradient: at stride 1, that forward over grad_output with the filter
// flipped (grad_input_as_forward); at stride 2 a strip per thread of input
// rows gathering the outputs that read them (transposed_strip).
//
// Weight gradient: each block of the forward's grid adds, for every tap, the
// products of its outputs' grad_output with the input patch it already holds
// (strip_grad_weight: one read of input and grad_output in all), over a few
// images (small_grad_weight_images), reduces them over its threads and
// writes one partial sum per tap; a second pass adds each tap's partial sums
// in a fixed order (deterministic, no atomics). Other geometries: per tap in
// row runs (grad_weight_rows).
#include <ATen/ATen.h>

#include <cstdint>
#include <type_traits>

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
  static constexpr int kThreads = kThreadsX * kThreadsY;
  // Blocks per SM the forward-shaped kernels (forward, input gradient) of
  // filter size K are compiled to fit (0: left to ptxas). With 7x7 taps
  // ptxas gave them 135-182 registers (sm_90, CUDA 13): one block of 256
  // threads an SM, whose loads then stall the SM between __syncthreads;
  // capped at 128 registers for two (24-60 bytes spilled). Any bound on the
  // smaller filters made ptxas take more registers than without (3x3
  // forward: 63 -> 95), and the weight-gradient kernels keep theirs (80 for
  // NCHW; NHWC would spill 208 bytes). Not measured on a GPU yet.
  static constexpr int fwd_min_blocks(int k) { return k == 7 ? 2 : 0; }
  static constexpr int kTileW = kThreadsX, kTileH = kThreadsY * kRows;
  static constexpr int64_t kMaxGridY = 65535;
};

// The input patch under a block's output tile, halo included.
template <int K, int S>
struct SmallPatch {
  static constexpr int kH = (SmallTile::kTileH - 1) * S + K;
  static constexpr int kW = (SmallTile::kTileW - 1) * S + K;
};

// A small-filter kernel's template arguments (k == 0: none serves).
struct SmallFilter {
  int k = 0, s = 1;
  DDPX_HD explicit operator bool() const { return k != 0; }
};

// Square K in {3, 5, 7}, one stride S in {1, 2} both ways, dilation 1: the
// shapes the small kernels are instantiated for.
DDPX_HD SmallFilter small_filter(const ConvGeom& g) {
  const bool square = g.kh == g.kw && (g.kh == 3 || g.kh == 5 || g.kh == 7);
  const bool strided = g.sh == g.sw && (g.sh == 1 || g.sh == 2);
  if (!square || !strided || g.dh != 1 || g.dw != 1) return {};
  return SmallFilter{static_cast<int>(g.kh), static_cast<int>(g.sh)};
}

// Whether the small-filter forward serves g (few input channels per group,
// and a grid the y axis holds).
DDPX_HD SmallFilter small_direct(const ConvGeom& g) {
  if (g.cig > 4 || ceil_div(g.oh, SmallTile::kTileH) > SmallTile::kMaxGridY) return {};
  return small_filter(g);
}

// The share of a small-filter grid's threads that own an output of g's
// planes: a block's tile is kTileH x kTileW outputs of one plane, so a plane
// narrower or shorter than the tile leaves the rest of it idle (56x56 and
// 28x28 planes: 0.77; 14x14: 0.19; 7x7: 0.05).
DDPX_HD double small_tile_fill(const ConvGeom& g) {
  const int64_t rows = ceil_div(g.oh, SmallTile::kTileH) * SmallTile::kTileH;
  const int64_t cols = ceil_div(g.ow, SmallTile::kTileW) * SmallTile::kTileW;
  return rows * cols > 0 ? static_cast<double>(g.oh * g.ow) / static_cast<double>(rows * cols)
                         : 0.0;
}

// Calls fn(integral_constant<K>, integral_constant<S>) for f's K and S: the
// one place the instantiated set is spelled out. (Host: the launch code and
// the emulation tests.)
template <typename Fn>
void with_small(SmallFilter f, Fn&& fn) {
  using std::integral_constant;
  const auto by_k = [&](auto s) {
    if (f.k == 3) {
      fn(integral_constant<int, 3>{}, s);
    } else if (f.k == 5) {
      fn(integral_constant<int, 5>{}, s);
    } else {
      fn(integral_constant<int, 7>{}, s);
    }
  };
  if (f.s == 1) {
    by_k(integral_constant<int, 1>{});
  } else {
    by_k(integral_constant<int, 2>{});
  }
}

// Top-left input coordinate of block (by, bx)'s patch (negative in the padding).
DDPX_HD int64_t small_origin_y(const ConvGeom& g, int64_t by) {
  return by * SmallTile::kTileH * g.sh - g.ph;
}
DDPX_HD int64_t small_origin_x(const ConvGeom& g, int64_t bx) {
  return bx * SmallTile::kTileW * g.sw - g.pw;
}

// Thread (tx, ty)'s share of a patch load: rows ty, ty + kThreadsY, ...;
// columns tx, tx + kThreadsX, ... (no division); zero in the padding. All
// of a thread's loads go out before its first store to shared memory: the
// plane's pointer may alias shared memory as far as the compiler knows, so
// a loop that stores each value before loading the next kept one load per
// thread in flight -- up to 27 of them a patch, each a memory latency (the
// seed's 3x3 forward at 2048^2 ran at 3.1x the copy floor on the H200,
// 2026-11-30; not profiled yet).
template <int K, int S, typename T, typename Acc>
DDPX_HD void small_load_patch(const T* plane, int64_t h, int64_t w, int64_t iy0, int64_t ix0,
                              Acc (*patch)[SmallPatch<K, S>::kW], int tx, int ty) {
  using P = SmallPatch<K, S>;
  constexpr int kRowIts = (P::kH + SmallTile::kThreadsY - 1) / SmallTile::kThreadsY;
  constexpr int kColIts = (P::kW + SmallTile::kThreadsX - 1) / SmallTile::kThreadsX;
  Acc v[kRowIts][kColIts];
  DDPX_UNROLL
  for (int i = 0; i < kRowIts; ++i) {
    const int r = ty + i * SmallTile::kThreadsY;
    const int64_t iy = iy0 + r;
    const bool row_in = r < P::kH && iy >= 0 && iy < h;
    DDPX_UNROLL
    for (int j = 0; j < kColIts; ++j) {
      const int c = tx + j * SmallTile::kThreadsX;
      const int64_t ix = ix0 + c;
      v[i][j] = row_in && c < P::kW && ix >= 0 && ix < w ? static_cast<Acc>(plane[iy * w + ix])
                                                         : Acc(0);
    }
  }
  DDPX_UNROLL
  for (int i = 0; i < kRowIts; ++i) {
    const int r = ty + i * SmallTile::kThreadsY;
    DDPX_UNROLL
    for (int j = 0; j < kColIts; ++j) {
      const int c = tx + j * SmallTile::kThreadsX;
      if (r < P::kH && c < P::kW) patch[r][c] = v[i][j];
    }
  }
}

// One input channel's K x K taps, into registers (every thread of a block
// reads the same addresses: one broadcast load each); `flip` rotates them by
// 180 degrees (the input gradient as a forward, for one filter per group).
template <int K, typename T, typename Acc>
DDPX_HD void small_load_taps(const T* taps, bool flip, Acc (&wk)[K][K]) {
  DDPX_UNROLL
  for (int i = 0; i < K; ++i) {
    DDPX_UNROLL
    for (int j = 0; j < K; ++j) {
      const int t = i * K + j;  // (flipped: tap (K-1-i, K-1-j), i.e. K*K-1-t)
      wk[i][j] = static_cast<Acc>(taps[flip ? K * K - 1 - t : t]);
    }
  }
}

// ---- strips: R outputs down one column -------------------------------------------------------
//
// A thread's R outputs (rows oy0 .. oy0+R-1 of one column) read input rows
// oy0*S - p + rr for rr in [0, (R-1)*S + K): row rr serves output r with tap
// row i = rr - r*S when 0 <= i < K, so (R-1)*S + K row loads of K values
// instead of R*K. `load(rr, j)` is the input under tap column j of that row:
// a shared-memory patch (PatchRows) or global memory (GlobalRows).

template <int K, int S, int R>
struct Strip {
  static constexpr int kRowsIn = (R - 1) * S + K;
};

// The patch rows of thread (tx, ty) of a SmallTile block.
template <int K, int S, typename Acc>
struct PatchRows {
  const Acc (*patch)[SmallPatch<K, S>::kW];
  int row0, col0;
  DDPX_HD PatchRows(const Acc (*p)[SmallPatch<K, S>::kW], int tx, int ty)
      : patch(p), row0(ty * SmallTile::kRows * S), col0(tx * S) {}
  DDPX_HD Acc operator()(int rr, int j) const { return patch[row0 + rr][col0 + j]; }
};

// Input rows read from global memory: element (iy, ix) of a plane at
// plane[iy * row_stride + ix * col_stride] (NCHW: w, 1; NHWC: w*c, c), zero
// outside [0, h) x [0, w); (iy0, ix0) is tap (0, 0) of the strip's first output.
template <typename T, typename Acc>
struct GlobalRows {
  const T* plane;
  int64_t h, w, row_stride, col_stride, iy0, ix0;
  DDPX_HD Acc operator()(int rr, int j) const {
    const int64_t iy = iy0 + rr, ix = ix0 + j;
    if (iy < 0 || iy >= h || ix < 0 || ix >= w) return Acc(0);
    return static_cast<Acc>(plane[iy * row_stride + ix * col_stride]);
  }
};

// The strip's (row, output) pairs: for each input row rr, the K values under
// the tap columns are loaded once, then fn(r, i, v) runs for every output r
// that row serves, with its tap row i (all indices constant once unrolled).
template <int K, int S, int R, typename Load, typename Fn>
DDPX_HD void strip_visit(const Load& load, const Fn& fn) {
  using Acc = decltype(load(0, 0));
  DDPX_UNROLL
  for (int rr = 0; rr < Strip<K, S, R>::kRowsIn; ++rr) {
    Acc v[K];
    DDPX_UNROLL
    for (int j = 0; j < K; ++j) v[j] = load(rr, j);
    DDPX_UNROLL
    for (int r = 0; r < R; ++r) {
      const int i = rr - r * S;
      if (i >= 0 && i < K) fn(r, i, v);
    }
  }
}

// acc[r] += the K x K taps over output r's window. Per output, taps are added
// row by row, left to right, as patch_dot does.
template <int K, int S, int R, typename Load, typename Acc>
DDPX_HD void strip_dot(const Load& load, const Acc (&wk)[K][K], Acc (&acc)[R]) {
  strip_visit<K, S, R>(load, [&](int r, int i, const Acc(&v)[K]) {
    DDPX_UNROLL
    for (int j = 0; j < K; ++j) acc[r] += wk[i][j] * v[j];
  });
}

// The weight gradient's share of the same strip: gw[i][j] += gv[r] * the
// input under tap (i, j) of output r (gv: grad_output of the R outputs, zero
// for outputs past the edge).
template <int K, int S, int R, typename Load, typename Acc>
DDPX_HD void strip_grad_weight(const Load& load, const Acc (&gv)[R], Acc (&gw)[K][K]) {
  strip_visit<K, S, R>(load, [&](int r, int i, const Acc(&v)[K]) {
    DDPX_UNROLL
    for (int j = 0; j < K; ++j) gw[i][j] += gv[r] * v[j];
  });
}

// The NCHW small-filter forward: thread (tx, ty) of block (by, bx) adds one
// input channel's taps to its kRows outputs from the block's patch.
template <int K, int S, typename Acc>
DDPX_HD void small_strip_dot(const Acc (*patch)[SmallPatch<K, S>::kW], const Acc (&wk)[K][K],
                             int tx, int ty, Acc (&acc)[SmallTile::kRows]) {
  strip_dot<K, S, SmallTile::kRows>(PatchRows<K, S, Acc>(patch, tx, ty), wk, acc);
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

// The small-filter forward that computes g's grad_input that way (stride 1;
// a padding over K-1 has no such form; the rest as small_direct).
DDPX_HD SmallFilter small_grad_input(const ConvGeom& g) {
  if (g.sh != 1 || g.sw != 1 || g.ph > g.kh - 1 || g.pw > g.kw - 1) return {};
  return small_direct(grad_input_as_forward(g));
}

// ---- input gradient as a gather (any stride, any padding) ----------------------------------

// acc[r] += the gradient reaching input row iy0 + r at column ix through one
// (output channel, input channel) pair's K x K taps wk: output (oy, ox) read
// input (oy*S - ph + i, ox*S - pw + j), so input (iy, ix) gathers the outputs
// with iy + ph - i = oy*S and ix + pw - j = ox*S, in range. The grad_output
// plane as GlobalRows lays it out (row_stride, col_stride). Per input, taps
// row by row, left to right.
template <int K, int S, int R, typename T, typename Acc>
DDPX_HD void transposed_strip(const T* go, int64_t oh, int64_t ow, int64_t row_stride,
                              int64_t col_stride, int64_t ph, int64_t pw, int64_t iy0, int64_t ix,
                              const Acc (&wk)[K][K], Acc (&acc)[R]) {
  int64_t col_off[K];
  bool col_in[K];
  DDPX_UNROLL
  for (int j = 0; j < K; ++j) {
    const int64_t t = ix + pw - j;
    col_in[j] = t >= 0 && t % S == 0 && t / S < ow;
    col_off[j] = col_in[j] ? (t / S) * col_stride : 0;
  }
  DDPX_UNROLL
  for (int r = 0; r < R; ++r) {
    DDPX_UNROLL
    for (int i = 0; i < K; ++i) {
      const int64_t t = iy0 + r + ph - i;
      if (t < 0 || t % S != 0 || t / S >= oh) continue;
      const T* row = go + (t / S) * row_stride;
      DDPX_UNROLL
      for (int j = 0; j < K; ++j) {
        if (col_in[j]) acc[r] += wk[i][j] * static_cast<Acc>(row[col_off[j]]);
      }
    }
  }
}

// The NCHW gather kernel: SmallTile blocks over the input planes (n * c),
// thread (tx, ty) of block (by, bx) owning input rows by*kTileH + ty*kRows +
// r at column bx*kTileW + tx. Serves small filters with at most 4 output
// channels per group (each input adds cog filters' taps).
DDPX_HD SmallFilter small_transposed(const ConvGeom& g) {
  if (g.cog > 4 || ceil_div(g.h, SmallTile::kTileH) > SmallTile::kMaxGridY) return {};
  return small_filter(g);
}

// Input row and column of thread (tx, ty)'s first row in block (by, bx);
// false when its column or first row is past the plane.
DDPX_HD bool transposed_input(const ConvGeom& g, int64_t by, int64_t bx, int tx, int ty,
                              int64_t* iy0, int64_t* ix) {
  *iy0 = by * SmallTile::kTileH + ty * SmallTile::kRows;
  *ix = bx * SmallTile::kTileW + tx;
  return *iy0 < g.h && *ix < g.w;
}

// ---- weight gradient on the forward's blocks -------------------------------------------------

// Whether the weight-gradient kernel sums several images a block: where that
// costs no registers. ptxas for sm_90 (CUDA 13): 3x3 at stride 1 uses 64
// registers either way; 5x5 and 7x7 went from 64-80 to 100-153 (the K*K sums
// live across the images' loads), 2 blocks of 256 threads an SM instead of
// 3-4. (Those run at 0.50x ATen's kernel, 7x7, and near it, 5x5; the 3x3 at
// stride 1 is the one that lost, 1.25-1.43x.)
DDPX_HD constexpr bool small_grad_weight_batches(int k, int s) { return k == 3 && s == 1; }

// A block sums `images` consecutive images' products in registers before its
// one block-wide reduction: that reduction is a shuffle tree per tap (K*K of
// them, 5 shuffles and adds each), more operations than a thread's 4 * K*K
// multiply-adds of one image (by our count of the source; not profiled); on
// the H200 (2026-11-30, CUDA graphs) the NCHW depthwise 3x3 c64 backward took
// 63 us against its forward's 15, the input gradient being that same forward
// kernel: about 48 us for the weight gradient, three forwards.
// About `target_blocks` blocks in all (the NHWC kernel's rule,
// nhwc_grad_weight_grid_z), never more images than the batch; one image
// where the kernel does not sum several (small_grad_weight_batches).
DDPX_HD int64_t small_grad_weight_images(const ConvGeom& g, int64_t target_blocks) {
  if (!small_grad_weight_batches(static_cast<int>(g.kh), static_cast<int>(g.sh))) return 1;
  const int64_t per_image =
      g.cout * ceil_div(g.oh, SmallTile::kTileH) * ceil_div(g.ow, SmallTile::kTileW);
  if (target_blocks < 1) target_blocks = 1;
  const int64_t images = (g.n * per_image + target_blocks / 2) / target_blocks;  // (nearest)
  if (images > g.n) return g.n < 1 ? 1 : g.n;
  return images < 1 ? 1 : images;
}

// Partial sums per tap: one per forward block of each group of `images`
// images, at partial[tap * splits + slot] with tap = (oc*cig + icg)*K*K +
// i*K + j (the weight's own layout).
DDPX_HD int64_t small_grad_weight_splits(const ConvGeom& g, int64_t images) {
  return ceil_div(g.n, images) * ceil_div(g.oh, SmallTile::kTileH) *
         ceil_div(g.ow, SmallTile::kTileW);
}
// Slot of block (by, bx) of image group `ng` (images ng*images ..).
DDPX_HD int64_t small_grad_weight_slot(const ConvGeom& g, int64_t ng, int64_t by, int64_t bx) {
  return (ng * ceil_div(g.oh, SmallTile::kTileH) + by) * ceil_div(g.ow, SmallTile::kTileW) + bx;
}

// Thread (tx, ty)'s grad_output over its kRows outputs of plane `go_plane`
// (zero past the edge, so they add nothing).
template <typename T, typename Acc>
DDPX_HD void small_load_grad_out(const ConvGeom& g, const T* go_plane, int64_t by, int64_t bx,
                                 int tx, int ty, Acc (&gv)[SmallTile::kRows]) {
  DDPX_UNROLL
  for (int r = 0; r < SmallTile::kRows; ++r) {
    int64_t oy, ox;
    gv[r] = small_output(g, by, bx, tx, ty, r, &oy, &ox)
                ? static_cast<Acc>(go_plane[oy * g.ow + ox])
                : Acc(0);
  }
}

// Thread `tid` of `nthreads`' share of a tap's sum over its `splits` partial
// sums (strided; the block then adds the shares as a tree, in a fixed order).
template <typename Acc>
DDPX_HD Acc partial_share(const Acc* tap_partials, int64_t splits, int tid, int nthreads) {
  Acc s = 0;
  for (int64_t k = tid; k < splits; k += nthreads) s += tap_partials[k];
  return s;
}

// A tap with fewer partial sums than this is added by one thread, in order
// (the row-run path: many taps, few runs each, where a block's tree would idle
// most of its threads); one with more by a block (partial_share, then a tree).
constexpr int64_t kBlockSumSplits = 256;

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
