#pragma once
// Tile, halo and index math of the CUDA tiled_conv2d kernels (the fast paths:
// conv_tile_small.h), as
// __host__ __device__ functions: kernels/cuda/tiled_conv2d_kernel.cu calls
// them with threadIdx/blockIdx, and tests/cpp/test_conv_tiles.cpp calls the
// very same functions for every emulated (block, thread) on the CPU.
//
// Layouts: input [n, c, h, w], weight [cout, cig, kh, kw], output
// [n, cout, oh, ow], all NCHW-contiguous; offsets are int64_t.
//
// Direct path (the seed's design, one thread per output): a block owns a
// kTileH x kTileW tile of one output plane (n, oc). For each input channel of
// the group the block loads the input patch under the tile, halo included,
//     patch_h = (kTileH - 1) * sh + (kh - 1) * dh + 1     (same for w)
// into shared memory (zeros where the patch hangs over the padding), then each
// thread sums its kh*kw taps from shared memory.
//
// GEMM path (many channels): per group, C[cog, n*oh*ow] = W_g[cog, kc] @ B
// with B[kc, n*oh*ow] the implicit im2col matrix, never stored: B tiles are
// gathered into shared memory straight from the input.
#include <cstddef>
#include <cstdint>

#include "kernels/common/host_device.h"

namespace ddpx::detail::tile {

struct ConvGeom {
  int64_t n, c, h, w;
  int64_t cout, kh, kw, oh, ow;
  int64_t sh, sw, ph, pw, dh, dw;
  int64_t groups, cig, cog;
};

DDPX_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- direct path ---------------------------------------------------------------------------

// Input patch (with halo) under a tile of tile_h x tile_w outputs.
DDPX_HD int64_t patch_h(const ConvGeom& g, int tile_h) {
  return (tile_h - 1) * g.sh + (g.kh - 1) * g.dh + 1;
}
DDPX_HD int64_t patch_w(const ConvGeom& g, int tile_w) {
  return (tile_w - 1) * g.sw + (g.kw - 1) * g.dw + 1;
}

// Block grid of the direct path: x = tiles along ow, y = tiles along oh,
// z = output planes n * cout.
struct DirectGrid {
  int64_t tiles_x, tiles_y, planes;
};
DDPX_HD DirectGrid direct_grid(const ConvGeom& g, int tile_h, int tile_w) {
  return DirectGrid{ceil_div(g.ow, tile_w), ceil_div(g.oh, tile_h), g.n * g.cout};
}

// Top-left input coordinate of the patch of tile (ty, tx); negative inside
// the top/left padding.
DDPX_HD int64_t patch_origin_y(const ConvGeom& g, int64_t tile_y, int tile_h) {
  return tile_y * tile_h * g.sh - g.ph;
}
DDPX_HD int64_t patch_origin_x(const ConvGeom& g, int64_t tile_x, int tile_w) {
  return tile_x * tile_w * g.sw - g.pw;
}

// Cooperative halo load: thread `tid` of `nthreads` copies patch elements
// tid, tid + nthreads, ... of one input plane into `patch` (row-major,
// ph_ x pw_), writing zero where the element lies in the padding.
template <typename T, typename Acc>
DDPX_HD void load_patch(const T* plane, int64_t h, int64_t w, int64_t iy0, int64_t ix0, int64_t ph_,
                        int64_t pw_, Acc* patch, int tid, int nthreads) {
  const int64_t total = ph_ * pw_;
  for (int64_t e = tid; e < total; e += nthreads) {
    const int64_t iy = iy0 + e / pw_, ix = ix0 + e % pw_;
    const bool inside = iy >= 0 && iy < h && ix >= 0 && ix < w;
    patch[e] = inside ? static_cast<Acc>(plane[iy * w + ix]) : Acc(0);
  }
}

// Output of thread (ly, lx) in tile (ty, tx); false when the tile hangs over
// the bottom/right edge of the output plane (the thread only helps loading).
DDPX_HD bool tile_output(const ConvGeom& g, int64_t tile_y, int64_t tile_x, int tile_h, int tile_w,
                         int ly, int lx, int64_t* oy, int64_t* ox) {
  *oy = tile_y * tile_h + ly;
  *ox = tile_x * tile_w + lx;
  return *oy < g.oh && *ox < g.ow;
}

// Sum of the kh*kw taps of one input channel for the thread at (ly, lx) of
// the tile; taps[i*kw + j] is that channel's filter.
template <typename Acc, typename Taps>
DDPX_HD Acc patch_dot(const ConvGeom& g, const Acc* patch, int64_t pw_, int ly, int lx,
                      const Taps& taps) {
  Acc s = 0;
  const Acc* base = patch + ly * g.sh * pw_ + lx * g.sw;
  for (int64_t i = 0; i < g.kh; ++i) {
    for (int64_t j = 0; j < g.kw; ++j) {
      s += static_cast<Acc>(taps[i * g.kw + j]) * base[i * g.dh * pw_ + j * g.dw];
    }
  }
  return s;
}

// The whole filter goes to __constant__ memory (read through the constant
// cache, one broadcast per warp when all threads read the same tap: the
// seed's design) when it fits this budget; otherwise each block stages its
// filter slice in shared memory.
constexpr int64_t kConstFilterBytes = 16384;
DDPX_HD bool filter_fits_constant(int64_t weight_numel, int64_t acc_bytes) {
  return weight_numel * acc_bytes <= kConstFilterBytes;
}

// Shared memory of one direct-path block: the patch of one input channel,
// plus the block's filter slice (cig * kh * kw) when it is not in the
// constant bank.
DDPX_HD int64_t direct_smem_bytes(const ConvGeom& g, int tile_h, int tile_w, int64_t acc_bytes,
                                  bool filter_in_constant) {
  const int64_t patch = patch_h(g, tile_h) * patch_w(g, tile_w);
  const int64_t filt = filter_in_constant ? 0 : g.cig * g.kh * g.kw;
  return (patch + filt) * acc_bytes;
}

// The direct path suits few input channels per group (each output reads
// cig*kh*kw taps from shared memory) and needs its patch in shared memory;
// everything else takes the GEMM path, so no valid input falls off a cliff.
DDPX_HD bool direct_can_implement(const ConvGeom& g, int tile_h, int tile_w, int64_t acc_bytes,
                                  int64_t smem_limit) {
  return g.cig <= 4 && direct_smem_bytes(g, tile_h, tile_w, acc_bytes,
                                         /*filter_in_constant=*/false) <= smem_limit;
}

// ---- GEMM path -------------------------------------------------------------------------------

// Column index p of B (p in [0, n*oh*ow)) -> (sample, oy, ox).
DDPX_HD void gemm_pixel(const ConvGeom& g, int64_t p, int64_t* nn, int64_t* oy, int64_t* ox) {
  const int64_t hw = g.oh * g.ow;
  *nn = p / hw;
  const int64_t r = p % hw;
  *oy = r / g.ow;
  *ox = r % g.ow;
}

// B[k, p] for group grp: k = (c*kh + i)*kw + j. Zero in the padding or out of range.
template <typename T, typename Acc>
DDPX_HD Acc gemm_b_element(const ConvGeom& g, const T* x, int64_t grp, int64_t k, int64_t p) {
  const int64_t kc = g.cig * g.kh * g.kw;
  if (k >= kc || p >= g.n * g.oh * g.ow) return Acc(0);
  const int64_t c = k / (g.kh * g.kw), ij = k % (g.kh * g.kw);
  const int64_t i = ij / g.kw, j = ij % g.kw;
  int64_t nn, oy, ox;
  gemm_pixel(g, p, &nn, &oy, &ox);
  const int64_t iy = oy * g.sh - g.ph + i * g.dh, ix = ox * g.sw - g.pw + j * g.dw;
  if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) return Acc(0);
  return static_cast<Acc>(x[((nn * g.c + grp * g.cig + c) * g.h + iy) * g.w + ix]);
}

// A[m, k] = W_g[m, k] for group grp, zero out of range.
template <typename T, typename Acc>
DDPX_HD Acc gemm_a_element(const ConvGeom& g, const T* wt, int64_t grp, int64_t m, int64_t k) {
  const int64_t kc = g.cig * g.kh * g.kw;
  if (m >= g.cog || k >= kc) return Acc(0);
  return static_cast<Acc>(wt[(grp * g.cog + m) * kc + k]);
}

// Cooperative load of one BK-slice: As[kk][mm] = A[m0+mm, k0+kk], Bs[kk][pp] =
// B[k0+kk, p0+pp]; thread tid of nthreads takes every nthreads-th element.
template <int BM, int BN, int BK, typename T, typename Acc>
DDPX_HD void gemm_load_tiles(const ConvGeom& g, const T* x, const T* wt, int64_t grp, int64_t m0,
                             int64_t p0, int64_t k0, Acc (*As)[BM], Acc (*Bs)[BN], int tid,
                             int nthreads) {
  for (int e = tid; e < BK * BM; e += nthreads) {
    const int kk = e / BM, mm = e % BM;
    As[kk][mm] = gemm_a_element<T, Acc>(g, wt, grp, m0 + mm, k0 + kk);
  }
  for (int e = tid; e < BK * BN; e += nthreads) {
    const int kk = e / BN, pp = e % BN;
    Bs[kk][pp] = gemm_b_element<T, Acc>(g, x, grp, k0 + kk, p0 + pp);
  }
}

// Output offset of C[m, p] for group grp, or -1 when (m, p) is outside.
DDPX_HD int64_t gemm_out_offset(const ConvGeom& g, int64_t grp, int64_t m, int64_t p) {
  if (m >= g.cog || p >= g.n * g.oh * g.ow) return -1;
  int64_t nn, oy, ox;
  gemm_pixel(g, p, &nn, &oy, &ox);
  return ((nn * g.cout + grp * g.cog + m) * g.oh + oy) * g.ow + ox;
}

// ---- backward ------------------------------------------------------------------------------

// grad_input[nn, c, y, x]: the sum over the outputs that read input (y, x):
// oy = (y + ph - i*dh) / sh when that division is exact and in range.
template <typename T, typename Acc>
DDPX_HD Acc grad_input_element(const ConvGeom& g, const T* go, const T* wt, int64_t nn, int64_t c,
                               int64_t y, int64_t x) {
  const int64_t grp = c / g.cig, icg = c % g.cig;
  Acc s = 0;
  for (int64_t i = 0; i < g.kh; ++i) {
    const int64_t ty = y + g.ph - i * g.dh;
    if (ty < 0 || ty % g.sh != 0 || ty / g.sh >= g.oh) continue;
    const int64_t oy = ty / g.sh;
    for (int64_t j = 0; j < g.kw; ++j) {
      const int64_t tx = x + g.pw - j * g.dw;
      if (tx < 0 || tx % g.sw != 0 || tx / g.sw >= g.ow) continue;
      const int64_t ox = tx / g.sw;
      for (int64_t m = 0; m < g.cog; ++m) {
        const int64_t oc = grp * g.cog + m;
        s += static_cast<Acc>(go[((nn * g.cout + oc) * g.oh + oy) * g.ow + ox]) *
             static_cast<Acc>(wt[((oc * g.cig + icg) * g.kh + i) * g.kw + j]);
      }
    }
  }
  return s;
}

// grad_weight: conv_tile_small.h's grad_weight_rows (row runs, any geometry).

}  // namespace ddpx::detail::tile
