// The channels_last depthwise CUDA kernels of ddpx::tiled_conv2d
// (conv_small_launch.h): thin shells over kernels/common/conv_tile_nhwc.h and
// the strips of conv_tile_small.h, whose index math the CPU tests emulate
// block by block. Instantiated for K = 3, 5, 7 and S = 1, 2.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

#include "kernels/common/conv_tile_nhwc.h"
#include "kernels/common/conv_tile_small.h"
#include "kernels/cuda/conv_small_launch.h"
#include "kernels/cuda/conv_sum_partials.cuh"

namespace ddpx::detail::cuda {
namespace {

using tile::ConvGeom;
using tile::NhwcTile;

// Stages the block's taps, then finds thread (tx, ty)'s channel, column (of
// `cols`) and K x K taps; false for a thread past the channels or columns
// (after the kernel's only block-wide sync: it may return).
template <int K, typename T, typename Acc>
__device__ bool nhwc_thread_taps(const T* wt, int64_t channels, int64_t cols, bool flip,
                                 Acc* staged, int64_t* ch, int64_t* col, Acc (&wk)[K][K]) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  tile::nhwc_stage_taps(wt, channels, K * K, blockIdx.x, staged, ty * NhwcTile::kThreadsC + tx);
  __syncthreads();
  if (!tile::nhwc_thread(channels, cols, blockIdx.x, blockIdx.y, tx, ty, ch, col)) return false;
  tile::nhwc_taps<K>(staged, tx, flip, wk);
  return true;
}

template <typename T, typename Acc, int K, int S>
__global__ void __launch_bounds__(NhwcTile::kThreads, tile::SmallTile::fwd_min_blocks(K))
    nhwc_fwd_kernel(const T* x, const T* wt, const T* bias, T* out, const ConvGeom g, bool flip) {
  __shared__ Acc staged[NhwcTile::kThreadsC * K * K];
  int64_t ch, col;
  Acc wk[K][K];
  if (!nhwc_thread_taps<K>(wt, g.c, g.ow, flip, staged, &ch, &col, wk)) return;
  const Acc b = bias != nullptr ? static_cast<Acc>(bias[ch]) : Acc(0);
  const int64_t strips = tile::nhwc_strips(g.n, g.oh);
  for (int64_t z = blockIdx.z; z < strips; z += gridDim.z) {
    int64_t nn, row0;
    tile::nhwc_strip(z, g.oh, &nn, &row0);
    Acc acc[NhwcTile::kRows];
#pragma unroll
    for (int r = 0; r < NhwcTile::kRows; ++r) acc[r] = b;
    tile::strip_dot<K, S, NhwcTile::kRows>(tile::nhwc_rows<T, Acc>(g, x, nn, ch, row0, col), wk,
                                           acc);
#pragma unroll
    for (int r = 0; r < NhwcTile::kRows; ++r) {
      if (row0 + r < g.oh) {
        out[tile::nhwc_offset(g.oh, g.ow, g.c, nn, row0 + r, col, ch)] = static_cast<T>(acc[r]);
      }
    }
  }
}

template <typename T, typename Acc, int K, int S>
__global__ void __launch_bounds__(NhwcTile::kThreads)
    nhwc_transposed_kernel(const T* go, const T* wt, T* gx, const ConvGeom g) {
  __shared__ Acc staged[NhwcTile::kThreadsC * K * K];
  int64_t ch, ix;
  Acc wk[K][K];
  if (!nhwc_thread_taps<K>(wt, g.c, g.w, false, staged, &ch, &ix, wk)) return;
  const int64_t strips = tile::nhwc_strips(g.n, g.h);
  for (int64_t z = blockIdx.z; z < strips; z += gridDim.z) {
    int64_t nn, row0;
    tile::nhwc_strip(z, g.h, &nn, &row0);
    Acc acc[NhwcTile::kRows] = {};
    tile::transposed_strip<K, S, NhwcTile::kRows>(go + nn * g.oh * g.ow * g.c + ch, g.oh, g.ow,
                                                  g.ow * g.c, g.c, g.ph, g.pw, row0, ix, wk, acc);
#pragma unroll
    for (int r = 0; r < NhwcTile::kRows; ++r) {
      if (row0 + r < g.h) {
        gx[tile::nhwc_offset(g.h, g.w, g.c, nn, row0 + r, ix, ch)] = static_cast<T>(acc[r]);
      }
    }
  }
}

template <typename T, typename Acc, int K, int S>
__global__ void __launch_bounds__(NhwcTile::kThreads)
    nhwc_grad_weight_kernel(const T* go, const T* x, const ConvGeom g, int64_t splits,
                            Acc* partial) {
  __shared__ Acc red[NhwcTile::kThreadsC][K * K];
  const int tx = threadIdx.x, ty = threadIdx.y;
  int64_t ch, col;
  const bool mine = tile::nhwc_thread(g.c, g.ow, blockIdx.x, blockIdx.y, tx, ty, &ch, &col);
  Acc gw[K][K] = {};
  if (mine) {
    const int64_t strips = tile::nhwc_strips(g.n, g.oh);
    for (int64_t z = blockIdx.z; z < strips; z += gridDim.z) {
      int64_t nn, row0;
      tile::nhwc_strip(z, g.oh, &nn, &row0);
      Acc gv[NhwcTile::kRows];
#pragma unroll
      for (int r = 0; r < NhwcTile::kRows; ++r) {
        gv[r] =
            row0 + r < g.oh
                ? static_cast<Acc>(go[tile::nhwc_offset(g.oh, g.ow, g.c, nn, row0 + r, col, ch)])
                : Acc(0);
      }
      tile::strip_grad_weight<K, S, NhwcTile::kRows>(
          tile::nhwc_rows<T, Acc>(g, x, nn, ch, row0, col), gv, gw);
    }
  }
  // The block's columns added in ty order, one row of threads at a time.
  for (int y = 0; y < NhwcTile::kThreadsX; ++y) {
    if (ty == y) {
#pragma unroll
      for (int t = 0; t < K * K; ++t)
        red[tx][t] = (y == 0 ? Acc(0) : red[tx][t]) + gw[t / K][t % K];
    }
    __syncthreads();
  }
  const int64_t slot = blockIdx.y * int64_t(gridDim.z) + blockIdx.z;
  for (int e = ty * NhwcTile::kThreadsC + tx; e < NhwcTile::kThreadsC * K * K;
       e += NhwcTile::kThreads) {
    const int64_t c = blockIdx.x * int64_t(NhwcTile::kThreadsC) + e / (K * K);
    if (c < g.c) partial[(c * K * K + e % (K * K)) * splits + slot] = red[e / (K * K)][e % (K * K)];
  }
}

}  // namespace

template <typename T, typename Acc>
bool nhwc_forward(const ConvGeom& g, const at::Tensor& x, const at::Tensor& wt,
                  const at::Tensor& bias, at::Tensor& out, cudaStream_t stream) {
  const tile::SmallFilter f = tile::nhwc_depthwise(g);
  if (!f) return false;
  const dim3 blocks(tile::ceil_div(g.c, NhwcTile::kThreadsC),
                    tile::ceil_div(g.ow, NhwcTile::kThreadsX),
                    tile::nhwc_grid_z(tile::nhwc_strips(g.n, g.oh)));
  const dim3 threads(NhwcTile::kThreadsC, NhwcTile::kThreadsX);
  const T* b = bias.defined() ? bias.data_ptr<T>() : nullptr;
  tile::with_small(f, [&](auto k, auto s) {
    nhwc_fwd_kernel<T, Acc, decltype(k)::value, decltype(s)::value><<<blocks, threads, 0, stream>>>(
        x.data_ptr<T>(), wt.data_ptr<T>(), b, out.data_ptr<T>(), g, false);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <typename T, typename Acc>
bool nhwc_grad_input(const ConvGeom& g, const at::Tensor& go, const at::Tensor& wt, at::Tensor& gx,
                     cudaStream_t stream) {
  const tile::SmallFilter f = tile::nhwc_depthwise(g);
  if (!f) return false;
  const dim3 threads(NhwcTile::kThreadsC, NhwcTile::kThreadsX);
  if (tile::small_grad_input(g)) {
    // A forward over grad_output with the filters flipped (depthwise: no
    // channel swap).
    const ConvGeom t = tile::grad_input_as_forward(g);
    const dim3 blocks(tile::ceil_div(t.c, NhwcTile::kThreadsC),
                      tile::ceil_div(t.ow, NhwcTile::kThreadsX),
                      tile::nhwc_grid_z(tile::nhwc_strips(t.n, t.oh)));
    tile::with_small(f, [&](auto k, auto s) {
      nhwc_fwd_kernel<T, Acc, decltype(k)::value, decltype(s)::value>
          <<<blocks, threads, 0, stream>>>(go.data_ptr<T>(), wt.data_ptr<T>(), nullptr,
                                           gx.data_ptr<T>(), t, true);
    });
  } else {
    const dim3 blocks(tile::ceil_div(g.c, NhwcTile::kThreadsC),
                      tile::ceil_div(g.w, NhwcTile::kThreadsX),
                      tile::nhwc_grid_z(tile::nhwc_strips(g.n, g.h)));
    tile::with_small(f, [&](auto k, auto s) {
      nhwc_transposed_kernel<T, Acc, decltype(k)::value, decltype(s)::value>
          <<<blocks, threads, 0, stream>>>(go.data_ptr<T>(), wt.data_ptr<T>(), gx.data_ptr<T>(), g);
    });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <typename T, typename Acc>
bool nhwc_grad_weight(const ConvGeom& g, const at::Tensor& go, const at::Tensor& x, at::Tensor& gw,
                      cudaStream_t stream) {
  const tile::SmallFilter f = tile::nhwc_depthwise(g);
  if (!f) return false;
  const int64_t grid_z = tile::nhwc_grad_weight_grid_z(g, grad_weight_target_blocks());
  const int64_t splits = tile::nhwc_grad_weight_splits(g, grid_z), taps = gw.numel();
  const at::Tensor partial =
      at::empty({taps * splits}, x.options().dtype(c10::CppTypeToScalarType<Acc>::value));
  const dim3 blocks(tile::ceil_div(g.c, NhwcTile::kThreadsC),
                    tile::ceil_div(g.ow, NhwcTile::kThreadsX), grid_z);
  const dim3 threads(NhwcTile::kThreadsC, NhwcTile::kThreadsX);
  tile::with_small(f, [&](auto k, auto s) {
    nhwc_grad_weight_kernel<T, Acc, decltype(k)::value, decltype(s)::value>
        <<<blocks, threads, 0, stream>>>(go.data_ptr<T>(), x.data_ptr<T>(), g, splits,
                                         partial.data_ptr<Acc>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_sum<T, Acc>(partial, taps, splits, gw, stream);
  return true;
}

#define DDPX_NHWC_CONV_INSTANTIATE(T, Acc)                                                      \
  template bool nhwc_forward<T, Acc>(const ConvGeom&, const at::Tensor&, const at::Tensor&,     \
                                     const at::Tensor&, at::Tensor&, cudaStream_t);             \
  template bool nhwc_grad_input<T, Acc>(const ConvGeom&, const at::Tensor&, const at::Tensor&,  \
                                        at::Tensor&, cudaStream_t);                             \
  template bool nhwc_grad_weight<T, Acc>(const ConvGeom&, const at::Tensor&, const at::Tensor&, \
                                         at::Tensor&, cudaStream_t);
DDPX_NHWC_CONV_INSTANTIATE(double, double)
DDPX_NHWC_CONV_INSTANTIATE(float, float)
DDPX_NHWC_CONV_INSTANTIATE(c10::Half, float)
DDPX_NHWC_CONV_INSTANTIATE(c10::BFloat16, float)
#undef DDPX_NHWC_CONV_INSTANTIATE

}  // namespace ddpx::detail::cuda
