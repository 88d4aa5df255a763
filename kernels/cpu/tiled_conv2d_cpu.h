#pragma once
// Pieces shared by the CPU forward (tiled_conv2d_kernel.cpp) and backward
// (tiled_conv2d_backward_kernel.cpp) kernels of ddpx::tiled_conv2d.
//
// Our two paths (tiled_conv2d_path.h chooses between them and ATen):
//  * direct: few input channels per group (single channel, depthwise, LeNet's
//    first layer). Each output plane is a sum of a few plane-by-filter
//    correlations done by the vectorised loops of tiled_conv2d_vec.cpp; work is
//    split into (plane, block of rows) tasks.
//  * implicit GEMM: many channels. The output is cut into tiles of whole rows;
//    for each (sample, group, tile) the input patch is gathered into a
//    contiguous panel col [cig*kh*kw, tile pixels] sized to stay in L2, and one
//    GEMM out_tile[cog, pixels] += W_g[cog, cig*kh*kw] @ col does the work.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/common/tiled_conv2d_args.h"
#include "kernels/cpu/tiled_conv2d_vec.h"

namespace ddpx::detail::cpu {

// The geometry as plain integers, batched (an unbatched input is one sample).
struct CpuConv : tile::ConvGeom {
  int64_t kc;  // GEMM reduction length cig * kh * kw
};

inline CpuConv make_cpu_conv(const Conv2dShape& s) {
  CpuConv p{conv_geom(s), 0};
  p.kc = p.cig * p.kh * p.kw;
  return p;
}

inline PlaneGeom forward_plane(const CpuConv& p) {
  return PlaneGeom{p.h, p.w, p.oh, p.ow, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw, p.dh, p.dw};
}

// Narrow planes with padding spend most of their time in the checked border
// loops; for them the rows a task reads are first copied into a zero-padded
// band, so that every tap is interior and vectorised.
inline bool use_padded_band(const PlaneGeom& g) { return (g.ph != 0 || g.pw != 0) && g.ow <= 256; }

// corr_rows over output rows [y0, y1), reading a padded copy of the input band
// (`band` is the caller's scratch buffer, reused across calls).
// The zero-padded copy of the input rows that output rows [y0, y1) read, and
// the geometry that addresses it with no padding (output row y0 -> band row 0).
template <typename T>
PlaneGeom padded_band(const PlaneGeom& g, const T* in, int64_t y0, int64_t y1,
                      std::vector<T>& band) {
  const int64_t r0 = y0 * g.sh - g.ph, r1 = (y1 - 1) * g.sh - g.ph + (g.kh - 1) * g.dh + 1;
  const int64_t c0 = -g.pw, c1 = (g.ow - 1) * g.sw - g.pw + (g.kw - 1) * g.dw + 1;
  const int64_t bh = r1 - r0, bw = c1 - c0;
  band.resize(bh * bw);
  const int64_t xa = std::clamp<int64_t>(c0, 0, g.w), xb = std::clamp<int64_t>(c1, xa, g.w);
  for (int64_t r = 0; r < bh; ++r) {
    T* dst = band.data() + r * bw;
    const int64_t iy = r0 + r;
    if (iy < 0 || iy >= g.h || xa == xb) {
      std::fill(dst, dst + bw, T(0));
      continue;
    }
    std::fill(dst, dst + (xa - c0), T(0));
    std::memcpy(dst + (xa - c0), in + iy * g.w + xa, (xb - xa) * sizeof(T));
    std::fill(dst + (xb - c0), dst + bw, T(0));
  }
  return PlaneGeom{bh, bw, y1 - y0, g.ow, g.kh, g.kw, g.sh, g.sw, 0, 0, g.dh, g.dw};
}

// corr_rows over output rows [y0, y1) of `out`, reading a padded band copy.
template <typename T>
void corr_rows_banded(CorrRowsFn<T> corr, const PlaneGeom& g, const T* in, const T* taps, T* out,
                      int64_t y0, int64_t y1, std::vector<T>& band) {
  const PlaneGeom b = padded_band(g, in, y0, y1, band);
  corr(b, band.data(), taps, out + y0 * g.ow, 0, y1 - y0);
}

// weight_rows over grad_output rows [y0, y1), reading a padded band copy.
template <typename T>
void weight_rows_banded(WeightRowsFn<T> wrows, const PlaneGeom& g, const T* in, const T* gout,
                        double* acc, int64_t y0, int64_t y1, std::vector<T>& band) {
  const PlaneGeom b = padded_band(g, in, y0, y1, band);
  wrows(b, band.data(), gout + y0 * g.ow, acc, 0, y1 - y0);
}

// How the GEMM path cuts the output: a tile is either several whole images
// (small images: one GEMM per tile instead of per image) or a band of rows of
// one image, sized by a panel budget in bytes and a floor on its columns.
// Measured (1 thread, A/B in one process) on LeNet conv2, ResNet 64ch@56 and
// 256ch@14: the forward is best at 1 MiB / 128 columns; the backward prefers
// 512 KiB but needs >= ~192 columns at 256 channels (its GEMMs have K = cols).
struct GemmTiling {
  int64_t images;  // images per tile (> 1 only when rows == oh)
  int64_t rows;    // output rows per tile
  int64_t chunks;  // tiles along the batch: ceil(n / images)
};

inline GemmTiling gemm_tiling(const CpuConv& p, int64_t elem_size, bool backward) {
  const int64_t budget = backward ? 512 * 1024 : 1024 * 1024;
  const int64_t min_cols = backward ? 192 : 128;
  const int64_t pix = std::max<int64_t>(p.oh * p.ow, 1);
  const int64_t cols = std::max<int64_t>(min_cols, budget / std::max<int64_t>(1, p.kc * elem_size));
  GemmTiling t;
  if (pix <= cols / 2) {
    t.images = std::clamp<int64_t>(cols / pix, 1, std::max<int64_t>(p.n, 1));
    t.rows = p.oh;
  } else {
    t.images = 1;
    t.rows = std::clamp<int64_t>(cols / std::max<int64_t>(p.ow, 1), 1, std::max<int64_t>(p.oh, 1));
  }
  t.chunks = (p.n + t.images - 1) / t.images;
  return t;
}

// Rows of output per direct-path task: ~16K outputs, enough work to hide the
// task overhead, small enough to balance two to a few dozen threads.
inline int64_t direct_block_rows(const CpuConv& p) {
  return std::clamp<int64_t>(16384 / std::max<int64_t>(p.ow, 1), 1, std::max<int64_t>(p.oh, 1));
}

// True when the GEMM can read the input directly as its panel: a 1x1 filter
// with unit stride and no padding makes col == x_g.
inline bool panel_is_input(const CpuConv& p) {
  return p.kh == 1 && p.kw == 1 && p.sh == 1 && p.sw == 1 && p.ph == 0 && p.pw == 0;
}

// col[r, (y - y0) * ow + x] = x_g[c, y*sh - ph + i*dh, x*sw - pw + j*dw] (0 outside)
// for panel rows r = (c*kh + i)*kw + j with c in [c0, c1).
// x_g: [cig, h, w] (one sample, one group); col: [kc, ld], ld >= (y1 - y0) * ow.
template <typename T>
void im2col_tile(const CpuConv& p, const T* x_g, int64_t y0, int64_t y1, T* col, int64_t ld,
                 int64_t c0, int64_t c1) {
  const int64_t pix = ld;
  for (int64_t c = c0; c < c1; ++c) {
    for (int64_t i = 0; i < p.kh; ++i) {
      for (int64_t j = 0; j < p.kw; ++j) {
        T* dst = col + ((c * p.kh + i) * p.kw + j) * pix;
        const int64_t ox = j * p.dw - p.pw;
        // Columns x with 0 <= x*sw + ox < w.
        const int64_t xa = ox >= 0 ? 0 : std::min(p.ow, (-ox + p.sw - 1) / p.sw);
        const int64_t xb =
            p.w - 1 - ox < 0 ? xa : std::clamp<int64_t>((p.w - 1 - ox) / p.sw + 1, xa, p.ow);
        for (int64_t y = y0; y < y1; ++y, dst += p.ow) {
          const int64_t iy = y * p.sh - p.ph + i * p.dh;
          if (iy < 0 || iy >= p.h) {
            std::fill(dst, dst + p.ow, T(0));
            continue;
          }
          const T* src = x_g + (c * p.h + iy) * p.w + ox;
          std::fill(dst, dst + xa, T(0));
          if (p.sw == 1) {
            std::memcpy(dst + xa, src + xa, (xb - xa) * sizeof(T));
          } else {
            for (int64_t x = xa; x < xb; ++x) dst[x] = src[x * p.sw];
          }
          std::fill(dst + xb, dst + p.ow, T(0));
        }
      }
    }
  }
}

// The adjoint of im2col_tile: x_g[c, ...] += col[r, ...] for c in [c0, c1).
// Tiles of one (sample, group) overlap in x_g (the halo), so callers run them
// one after another; different channels c never collide.
template <typename T>
void col2im_tile_add(const CpuConv& p, const T* col, int64_t ld, int64_t y0, int64_t y1, T* x_g,
                     int64_t c0, int64_t c1) {
  const int64_t pix = ld;
  for (int64_t c = c0; c < c1; ++c) {
    for (int64_t i = 0; i < p.kh; ++i) {
      for (int64_t j = 0; j < p.kw; ++j) {
        const T* src = col + ((c * p.kh + i) * p.kw + j) * pix;
        const int64_t ox = j * p.dw - p.pw;
        const int64_t xa = ox >= 0 ? 0 : std::min(p.ow, (-ox + p.sw - 1) / p.sw);
        const int64_t xb =
            p.w - 1 - ox < 0 ? xa : std::clamp<int64_t>((p.w - 1 - ox) / p.sw + 1, xa, p.ow);
        for (int64_t y = y0; y < y1; ++y, src += p.ow) {
          const int64_t iy = y * p.sh - p.ph + i * p.dh;
          if (iy < 0 || iy >= p.h) continue;
          T* dst = x_g + (c * p.h + iy) * p.w + ox;
          if (p.sw == 1) {
            for (int64_t x = xa; x < xb; ++x) dst[x] += src[x];
          } else {
            for (int64_t x = xa; x < xb; ++x) dst[x * p.sw] += src[x];
          }
        }
      }
    }
  }
}

// A 2-D [rows, cols] view with row stride ld over raw memory owned elsewhere.
inline at::Tensor view2d(void* data, int64_t rows, int64_t cols, int64_t ld,
                         const at::TensorOptions& opts) {
  return at::from_blob(data, {rows, cols}, {ld, 1}, opts);
}

// The GEMM's [kc, cols] input panel for images [n0, n1) and output rows
// [y0, y1) of group `grp` (forward and weight gradient share it): the input
// itself when `direct` (panel_is_input and one image), else im2col into `col`
// ([kc, cols]), channels in parallel unless tasks already are (`outer`).
template <typename T>
at::Tensor input_panel(const CpuConv& p, T* x, int64_t grp, int64_t n0, int64_t n1, int64_t y0,
                       int64_t y1, bool direct, bool outer, T* col, const at::TensorOptions& opts) {
  auto x_g = [&](int64_t nn) { return x + (nn * p.c + grp * p.cig) * p.h * p.w; };
  const int64_t pix = (y1 - y0) * p.ow, cols = (n1 - n0) * pix;
  if (direct) return view2d(x_g(n0) + y0 * p.ow, p.kc, pix, p.h * p.w, opts);
  for (int64_t nn = n0; nn < n1; ++nn) {
    T* dst = col + (nn - n0) * pix;
    if (outer) {
      im2col_tile(p, x_g(nn), y0, y1, dst, cols, 0, p.cig);
    } else {
      at::parallel_for(0, p.cig, 1, [&](int64_t c0, int64_t c1) {
        im2col_tile(p, x_g(nn), y0, y1, dst, cols, c0, c1);
      });
    }
  }
  return view2d(col, p.kc, cols, cols, opts);
}

// Whether the batch alone keeps every thread busy; otherwise one task runs at
// a time with the GEMM and the gathers parallel inside.
bool batch_parallel(int64_t tasks);

// Makes the BLAS called from this thread sequential while alive. Our tasks
// already occupy every thread; MKL called inside them would otherwise start
// its own team per call and oversubscribe the cores (measured: 2-3x slower on
// 2 threads). A no-op when torch's BLAS is not MKL.
class SequentialBlasGuard {
 public:
  SequentialBlasGuard();
  ~SequentialBlasGuard();
  SequentialBlasGuard(const SequentialBlasGuard&) = delete;
  SequentialBlasGuard& operator=(const SequentialBlasGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace ddpx::detail::cpu
