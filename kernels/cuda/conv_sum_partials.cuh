#pragma once
// The weight gradients' second pass, shared by every CUDA conv backward
// (conv_small_kernel.cu, conv_nhwc_kernel.cu, the row runs of
// tiled_conv2d_kernel.cu): each tap's partial sums (one per block of the
// first pass, at partial[tap * splits + slot]) added in a fixed order.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>

#include "kernels/common/conv_tile_small.h"

namespace ddpx::detail::cuda {

constexpr int kSumThreads = 256;

// Blocks the weight gradients' first passes aim at in all: about 8 per SM of
// the current device (each block then sums in registers what is left over,
// and writes fewer partial sums).
inline int64_t grad_weight_target_blocks() {
  return 8 * int64_t{at::cuda::getCurrentDeviceProperties()->multiProcessorCount};
}

// gw[tap] = the sum of tap's `splits` partial sums: one block per tap,
// strided shares, then a tree (the same order every call).
template <typename T, typename Acc>
__global__ void __launch_bounds__(kSumThreads)
    sum_partials_kernel(const Acc* partial, int64_t taps, int64_t splits, T* gw) {
  __shared__ Acc part[kSumThreads];
  for (int64_t tap = blockIdx.x; tap < taps; tap += gridDim.x) {
    part[threadIdx.x] =
        tile::partial_share(partial + tap * splits, splits, threadIdx.x, kSumThreads);
    __syncthreads();
    for (int half = kSumThreads / 2; half > 0; half /= 2) {
      if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
      __syncthreads();
    }
    if (threadIdx.x == 0) gw[tap] = static_cast<T>(part[0]);
    __syncthreads();  // part[0] is read before the next tap overwrites it
  }
}

// gw[tap] = the sum of tap's partial sums, one thread per tap, in slot order.
template <typename T, typename Acc>
__global__ void sum_partials_serial_kernel(const Acc* partial, int64_t taps, int64_t splits,
                                           T* gw) {
  for (int64_t tap = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; tap < taps;
       tap += int64_t(gridDim.x) * blockDim.x) {
    Acc s = 0;
    for (int64_t k = 0; k < splits; ++k) s += partial[tap * splits + k];
    gw[tap] = static_cast<T>(s);
  }
}

// The sum pass (tile::kBlockSumSplits says which kernel).
template <typename T, typename Acc>
inline void launch_sum(const at::Tensor& partial, int64_t taps, int64_t splits, at::Tensor& gw,
                       cudaStream_t stream) {
  if (splits < tile::kBlockSumSplits) {
    const int64_t blocks = std::min<int64_t>(tile::ceil_div(taps, kSumThreads), 65535);
    sum_partials_serial_kernel<T, Acc><<<blocks, kSumThreads, 0, stream>>>(
        partial.data_ptr<Acc>(), taps, splits, gw.data_ptr<T>());
  } else {
    sum_partials_kernel<T, Acc><<<std::min<int64_t>(taps, 65535), kSumThreads, 0, stream>>>(
        partial.data_ptr<Acc>(), taps, splits, gw.data_ptr<T>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ddpx::detail::cuda
