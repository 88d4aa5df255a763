// The small-filter CUDA kernels of ddpx::tiled_conv2d on NCHW tensors
// (conv_small_launch.h): thin shells over kernels/common/conv_tile_small.h,
// whose index math the CPU tests emulate block by block. Instantiated for
// K = 3, 5, 7 and S = 1, 2 (tile::with_small). channels_last depthwise:
// conv_nhwc_kernel.cu.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

#include "kernels/common/conv_tile_small.h"
#include "kernels/cuda/conv_small_launch.h"
#include "kernels/cuda/conv_sum_partials.cuh"

namespace ddpx::detail::cuda {
namespace {

using tile::ConvGeom;
using tile::SmallTile;
constexpr int64_t kMaxGridZ = 65535;

template <typename T>
struct SmallFwd {
  const T* x;     // [n, c, h, w]
  const T* wt;    // [cout, cig, K, K]
  const T* bias;  // [cout] or nullptr
  T* out;         // [n, cout, oh, ow]
  ConvGeom g;
  bool flip;  // taps rotated by 180 degrees (cig == cog == 1: the input gradient as a forward)
};

template <typename T, typename Acc, int K, int S>
__global__ void __launch_bounds__(SmallTile::kThreads, SmallTile::fwd_min_blocks(K))
    small_fwd_kernel(const SmallFwd<T> p) {
  __shared__ Acc patch[tile::SmallPatch<K, S>::kH][tile::SmallPatch<K, S>::kW];
  const ConvGeom& g = p.g;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t iy0 = tile::small_origin_y(g, blockIdx.y);
  const int64_t ix0 = tile::small_origin_x(g, blockIdx.x);
  // z covers n*cout planes, striding when there are more than the grid allows.
  for (int64_t plane = blockIdx.z; plane < g.n * g.cout; plane += gridDim.z) {
    const int64_t nn = plane / g.cout, oc = plane % g.cout, grp = oc / g.cog;
    const Acc b = p.bias != nullptr ? static_cast<Acc>(p.bias[oc]) : Acc(0);
    Acc acc[SmallTile::kRows];
#pragma unroll
    for (int r = 0; r < SmallTile::kRows; ++r) acc[r] = b;
    for (int64_t icg = 0; icg < g.cig; ++icg) {
      Acc wk[K][K];
      tile::small_load_taps<K>(p.wt + (oc * g.cig + icg) * K * K, p.flip, wk);
      __syncthreads();  // everyone is done reading the previous patch
      tile::small_load_patch<K, S>(p.x + (nn * g.c + grp * g.cig + icg) * g.h * g.w, g.h, g.w, iy0,
                                   ix0, patch, tx, ty);
      __syncthreads();
      tile::small_strip_dot<K, S>(patch, wk, tx, ty, acc);
    }
#pragma unroll
    for (int r = 0; r < SmallTile::kRows; ++r) {
      int64_t oy, ox;
      if (tile::small_output(g, blockIdx.y, blockIdx.x, tx, ty, r, &oy, &ox)) {
        p.out[(plane * g.oh + oy) * g.ow + ox] = static_cast<T>(acc[r]);
      }
    }
  }
}

template <typename T, typename Acc, int K, int S>
__global__ void __launch_bounds__(SmallTile::kThreads, SmallTile::fwd_min_blocks(K))
    small_transposed_kernel(const T* go, const T* wt, T* gx, const ConvGeom g) {
  int64_t iy0, ix;
  if (!tile::transposed_input(g, blockIdx.y, blockIdx.x, threadIdx.x, threadIdx.y, &iy0, &ix)) {
    return;  // (no block-wide sync below)
  }
  for (int64_t plane = blockIdx.z; plane < g.n * g.c; plane += gridDim.z) {
    const int64_t nn = plane / g.c, c = plane % g.c, grp = c / g.cig, icg = c % g.cig;
    Acc acc[SmallTile::kRows] = {};
    for (int64_t m = 0; m < g.cog; ++m) {
      const int64_t oc = grp * g.cog + m;
      Acc wk[K][K];
      tile::small_load_taps<K>(wt + (oc * g.cig + icg) * K * K, false, wk);
      tile::transposed_strip<K, S, SmallTile::kRows>(go + (nn * g.cout + oc) * g.oh * g.ow, g.oh,
                                                     g.ow, g.ow, 1, g.ph, g.pw, iy0, ix, wk, acc);
    }
#pragma unroll
    for (int r = 0; r < SmallTile::kRows; ++r) {
      if (iy0 + r < g.h) gx[(plane * g.h + iy0 + r) * g.w + ix] = static_cast<T>(acc[r]);
    }
  }
}

// The sum of every thread's gw[tap] into red[warp][tap] (lane order fixed by
// the shuffle tree), then thread t < K*K adds the warps in order: returns
// thread t's tap sum (meaningful for t < K*K). Every thread must call it.
template <int K, typename Acc>
__device__ Acc block_sum_taps(const Acc (&gw)[K][K], Acc (*red)[K * K]) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, lane = tid % 32, warp = tid / 32;
#pragma unroll
  for (int t = 0; t < K * K; ++t) {
    Acc v = gw[t / K][t % K];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
    if (lane == 0) red[warp][t] = v;
  }
  __syncthreads();
  Acc s = 0;
  if (tid < K * K) {
    for (int w = 0; w < SmallTile::kThreads / 32; ++w) s += red[w][tid];
  }
  __syncthreads();  // red is free again
  return s;
}

// Block (bx, by) of item z = (image group ng, filter oc): the weight
// gradient's partial sums over images ng*images .. of its tile.
template <typename T, typename Acc, int K, int S>
__global__ void __launch_bounds__(SmallTile::kThreads)
    small_grad_weight_kernel(const T* go, const T* x, const ConvGeom g, int64_t images,
                             int64_t splits, Acc* partial) {
  __shared__ Acc patch[tile::SmallPatch<K, S>::kH][tile::SmallPatch<K, S>::kW];
  __shared__ Acc red[SmallTile::kThreads / 32][K * K];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t iy0 = tile::small_origin_y(g, blockIdx.y);
  const int64_t ix0 = tile::small_origin_x(g, blockIdx.x);
  // (Elsewhere images is 1, and the loop over them one pass the compiler sees.)
  constexpr bool kBatches = tile::small_grad_weight_batches(K, S);
  const int64_t items = tile::ceil_div(g.n, images) * g.cout;
  for (int64_t item = blockIdx.z; item < items; item += gridDim.z) {
    const int64_t ng = item / g.cout, oc = item % g.cout, grp = oc / g.cog;
    const int64_t n0 = ng * images;
    const int64_t n1 = !kBatches ? n0 + 1 : n0 + images < g.n ? n0 + images : g.n;
    const int64_t slot = tile::small_grad_weight_slot(g, ng, blockIdx.y, blockIdx.x);
    for (int64_t icg = 0; icg < g.cig; ++icg) {
      Acc gw[K][K] = {};
      for (int64_t nn = n0; nn < n1; ++nn) {
        Acc gv[SmallTile::kRows];
        tile::small_load_grad_out(g, go + (nn * g.cout + oc) * g.oh * g.ow, blockIdx.y, blockIdx.x,
                                  tx, ty, gv);
        __syncthreads();  // everyone is done reading the previous patch
        tile::small_load_patch<K, S>(x + (nn * g.c + grp * g.cig + icg) * g.h * g.w, g.h, g.w,
                                     iy0, ix0, patch, tx, ty);
        __syncthreads();
        tile::strip_grad_weight<K, S, SmallTile::kRows>(tile::PatchRows<K, S, Acc>(patch, tx, ty),
                                                        gv, gw);
      }
      const Acc s = block_sum_taps<K>(gw, red);
      const int tid = ty * SmallTile::kThreadsX + tx;
      if (tid < K * K) partial[((oc * g.cig + icg) * K * K + tid) * splits + slot] = s;
    }
  }
}

}  // namespace

template <typename T, typename Acc>
bool small_forward(const ConvGeom& g, const at::Tensor& x, const at::Tensor& wt,
                   const at::Tensor& bias, at::Tensor& out, cudaStream_t stream) {
  const tile::SmallFilter f = tile::small_direct(g);
  if (!f) return false;
  const SmallFwd<T> p{x.data_ptr<T>(),
                      wt.data_ptr<T>(),
                      bias.defined() ? bias.data_ptr<T>() : nullptr,
                      out.data_ptr<T>(),
                      g,
                      false};
  const dim3 blocks(tile::ceil_div(g.ow, SmallTile::kTileW),
                    tile::ceil_div(g.oh, SmallTile::kTileH), std::min(g.n * g.cout, kMaxGridZ));
  const dim3 threads(SmallTile::kThreadsX, SmallTile::kThreadsY);
  tile::with_small(f, [&](auto k, auto s) {
    small_fwd_kernel<T, Acc, decltype(k)::value, decltype(s)::value>
        <<<blocks, threads, 0, stream>>>(p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <typename T, typename Acc>
bool small_grad_input(const ConvGeom& g, const at::Tensor& go, const at::Tensor& wt, at::Tensor& gx,
                      cudaStream_t stream) {
  const dim3 threads(SmallTile::kThreadsX, SmallTile::kThreadsY);
  if (const tile::SmallFilter f = tile::small_grad_input(g)) {
    // A forward over grad_output (grad_input_as_forward); one filter per
    // group each way is that filter flipped, read so by the kernel.
    const ConvGeom t = tile::grad_input_as_forward(g);
    const bool flip_only = g.cig == 1 && g.cog == 1;
    const at::Tensor filt = flip_only ? wt : tile::grad_input_filter(wt, g.groups);
    const SmallFwd<T> p{go.data_ptr<T>(), filt.data_ptr<T>(), nullptr, gx.data_ptr<T>(), t,
                        flip_only};
    const dim3 blocks(tile::ceil_div(t.ow, SmallTile::kTileW),
                      tile::ceil_div(t.oh, SmallTile::kTileH), std::min(t.n * t.cout, kMaxGridZ));
    tile::with_small(f, [&](auto k, auto s) {
      small_fwd_kernel<T, Acc, decltype(k)::value, decltype(s)::value>
          <<<blocks, threads, 0, stream>>>(p);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  }
  const tile::SmallFilter f = tile::small_transposed(g);
  if (!f) return false;
  const dim3 blocks(tile::ceil_div(g.w, SmallTile::kTileW), tile::ceil_div(g.h, SmallTile::kTileH),
                    std::min(g.n * g.c, kMaxGridZ));
  tile::with_small(f, [&](auto k, auto s) {
    small_transposed_kernel<T, Acc, decltype(k)::value, decltype(s)::value>
        <<<blocks, threads, 0, stream>>>(go.data_ptr<T>(), wt.data_ptr<T>(), gx.data_ptr<T>(), g);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <typename T, typename Acc>
bool small_grad_weight(const ConvGeom& g, const at::Tensor& go, const at::Tensor& x, at::Tensor& gw,
                       cudaStream_t stream) {
  const tile::SmallFilter f = tile::small_direct(g);
  if (!f) return false;
  const int64_t images = tile::small_grad_weight_images(g, grad_weight_target_blocks());
  const int64_t splits = tile::small_grad_weight_splits(g, images), taps = gw.numel();
  const at::Tensor partial =
      at::empty({taps * splits}, x.options().dtype(c10::CppTypeToScalarType<Acc>::value));
  const dim3 blocks(tile::ceil_div(g.ow, SmallTile::kTileW),
                    tile::ceil_div(g.oh, SmallTile::kTileH),
                    std::min(tile::ceil_div(g.n, images) * g.cout, kMaxGridZ));
  const dim3 threads(SmallTile::kThreadsX, SmallTile::kThreadsY);
  tile::with_small(f, [&](auto k, auto s) {
    small_grad_weight_kernel<T, Acc, decltype(k)::value, decltype(s)::value>
        <<<blocks, threads, 0, stream>>>(go.data_ptr<T>(), x.data_ptr<T>(), g, images, splits,
                                         partial.data_ptr<Acc>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_sum<T, Acc>(partial, taps, splits, gw, stream);
  return true;
}

#define DDPX_SMALL_CONV_INSTANTIATE(T, Acc)                                                      \
  template bool small_forward<T, Acc>(const ConvGeom&, const at::Tensor&, const at::Tensor&,     \
                                      const at::Tensor&, at::Tensor&, cudaStream_t);             \
  template bool small_grad_input<T, Acc>(const ConvGeom&, const at::Tensor&, const at::Tensor&,  \
                                         at::Tensor&, cudaStream_t);                             \
  template bool small_grad_weight<T, Acc>(const ConvGeom&, const at::Tensor&, const at::Tensor&, \
                                          at::Tensor&, cudaStream_t);
DDPX_SMALL_CONV_INSTANTIATE(double, double)
DDPX_SMALL_CONV_INSTANTIATE(float, float)
DDPX_SMALL_CONV_INSTANTIATE(c10::Half, float)
DDPX_SMALL_CONV_INSTANTIATE(c10::BFloat16, float)
#undef DDPX_SMALL_CONV_INSTANTIATE

}  // namespace ddpx::detail::cuda
