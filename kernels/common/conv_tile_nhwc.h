#pragma once
// Depthwise convolution on channels_last (NHWC) tensors, as __host__
// __device__ functions (kernels/cuda/conv_small_kernel.cu launches them,
// tests/cpp/test_conv_tiles_small.cpp emulates every block and thread).
//
// Why a kernel of its own: in NHWC the C channels of a pixel are adjacent, so
// the NCHW kernels' blocks (32 columns of one plane) would read 32 pixels C
// elements apart; converting to NCHW and back costs two extra passes over
// the data, as much as the convolution itself. PyTorch sends channels_last
// depthwise convolution to cuDNN (float32 NCHW goes to ATen's own
// conv_depthwise2d).
//
// Layout: x [n, h, w, c], grad_output / out [n, oh, ow, c], weight [c, 1, K, K]
// (groups == c == cout: one filter per channel). A block is kThreadsC x
// kThreadsX threads: thread (tx, ty) of block (bc, bx, bz) works on channel
// bc*kThreadsC + tx (a warp reads 32 adjacent channels: one coalesced
// 128-byte line per pixel in float32) at column bx*kThreadsX + ty, for the
// strips bz, bz + gridDim.z, ... of kRows rows (image and first row:
// nhwc_strip); the strips of conv_tile_small.h read its rows from global
// memory (neighbouring columns' reuse goes through L1). The block stages its
// channels' taps in shared memory once (nhwc_stage_taps).
#include <cstdint>

#include "kernels/common/conv_tile.h"
#include "kernels/common/conv_tile_small.h"
#include "kernels/common/host_device.h"

namespace ddpx::detail::tile {

struct NhwcTile {
  static constexpr int kThreadsC = 32, kThreadsX = 8, kRows = 4;
  static constexpr int kThreads = kThreadsC * kThreadsX;
  static constexpr int64_t kMaxGrid = 65535;  // y and z
};

// The filters the NHWC kernels serve: depthwise, multiplier 1, small
// (conv_tile_small.h's K and S).
DDPX_HD SmallFilter nhwc_depthwise(const ConvGeom& g) {
  if (g.groups != g.c || g.cout != g.c) return {};
  if (ceil_div(g.ow, NhwcTile::kThreadsX) > NhwcTile::kMaxGrid) return {};
  if (ceil_div(g.w, NhwcTile::kThreadsX) > NhwcTile::kMaxGrid) return {};
  return small_filter(g);
}

// Strips of kRows rows over `rows` rows of each of n images.
DDPX_HD int64_t nhwc_strips(int64_t n, int64_t rows) { return n * ceil_div(rows, NhwcTile::kRows); }
DDPX_HD void nhwc_strip(int64_t z, int64_t rows, int64_t* nn, int64_t* row0) {
  const int64_t per = ceil_div(rows, NhwcTile::kRows);
  *nn = z / per;
  *row0 = (z % per) * NhwcTile::kRows;
}

// Grid z: the strips, at most kMaxGrid (blocks then stride over them).
DDPX_HD int64_t nhwc_grid_z(int64_t strips) {
  return strips < NhwcTile::kMaxGrid ? strips : NhwcTile::kMaxGrid;
}

// Thread (tx, ty)'s channel and column; false when either is past the end.
DDPX_HD bool nhwc_thread(int64_t channels, int64_t cols, int64_t bc, int64_t bx, int tx, int ty,
                         int64_t* ch, int64_t* col) {
  *ch = bc * NhwcTile::kThreadsC + tx;
  *col = bx * NhwcTile::kThreadsX + ty;
  return *ch < channels && *col < cols;
}

// Thread `tid`'s share of staging block bc's taps: the weight rows of its
// kThreadsC channels are one contiguous run of weight; staged[t] = weight[bc
// * kThreadsC * kk + t] for the channels that exist.
template <typename T, typename Acc>
DDPX_HD void nhwc_stage_taps(const T* weight, int64_t channels, int64_t kk, int64_t bc, Acc* staged,
                             int tid) {
  const int64_t first = bc * NhwcTile::kThreadsC;
  const int64_t have =
      channels - first < NhwcTile::kThreadsC ? channels - first : NhwcTile::kThreadsC;
  for (int64_t t = tid; t < have * kk; t += NhwcTile::kThreads) {
    staged[t] = static_cast<Acc>(weight[first * kk + t]);
  }
}

// Thread tx's K x K taps from the staged block (flipped: the taps of the
// input gradient as a forward, grad_input_as_forward).
template <int K, typename Acc>
DDPX_HD void nhwc_taps(const Acc* staged, int tx, bool flip, Acc (&wk)[K][K]) {
  DDPX_UNROLL
  for (int i = 0; i < K; ++i) {
    DDPX_UNROLL
    for (int j = 0; j < K; ++j) {
      wk[i][j] = flip ? staged[tx * K * K + (K - 1 - i) * K + (K - 1 - j)]
                      : staged[tx * K * K + i * K + j];
    }
  }
}

// Image nn's input rows as a strip reads them: channel ch of x [n, h, w, c];
// the strip's first output (row0, col) reads from (row0*S - ph, col*S - pw).
template <typename T, typename Acc>
DDPX_HD GlobalRows<T, Acc> nhwc_rows(const ConvGeom& g, const T* x, int64_t nn, int64_t ch,
                                     int64_t row0, int64_t col) {
  return GlobalRows<T, Acc>{x + nn * g.h * g.w * g.c + ch,
                            g.h,
                            g.w,
                            g.w * g.c,
                            g.c,
                            row0 * g.sh - g.ph,
                            col * g.sw - g.pw};
}

// Offset of (nn, row, col, ch) in an [n, rows, cols, c] tensor.
DDPX_HD int64_t nhwc_offset(int64_t rows, int64_t cols, int64_t c, int64_t nn, int64_t row,
                            int64_t col, int64_t ch) {
  return ((nn * rows + row) * cols + col) * c + ch;
}

// Weight gradient: partial[(ch*K*K + tap) * splits + slot], one slot per
// block column of the grid, slot = bx * grid_z + bz: each block adds its
// threads' sums over their columns (ty order) before writing.
DDPX_HD int64_t nhwc_grad_weight_splits(const ConvGeom& g, int64_t grid_z) {
  return ceil_div(g.ow, NhwcTile::kThreadsX) * grid_z;
}

// Grid z of the weight gradient: enough blocks for `target_blocks` in all
// (each block's strips summed in registers first: fewer partial sums).
DDPX_HD int64_t nhwc_grad_weight_grid_z(const ConvGeom& g, int64_t target_blocks) {
  const int64_t xy = ceil_div(g.c, NhwcTile::kThreadsC) * ceil_div(g.ow, NhwcTile::kThreadsX);
  int64_t z = ceil_div(target_blocks, xy);
  const int64_t strips = nhwc_strips(g.n, g.oh);
  if (z > strips) z = strips;
  if (z > NhwcTile::kMaxGrid) z = NhwcTile::kMaxGrid;
  return z < 1 ? 1 : z;
}

}  // namespace ddpx::detail::tile
