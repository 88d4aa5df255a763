#pragma once
// The small-filter CUDA kernels of ddpx::tiled_conv2d (conv_small_kernel.cu:
// K = 3/5/7, stride 1/2; NCHW and, for depthwise, channels_last), as launch
// functions for tiled_conv2d_kernel.cu. Each returns false, launching
// nothing, when its kernels do not serve the geometry (the caller takes its
// general path); tensors are contiguous in the layout the name says, on the
// current device, outputs allocated by the caller. T is the element type and
// Acc its accumulation type (at::acc_type<T, true>).
#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include "kernels/common/conv_tile.h"

namespace ddpx::detail::cuda {

// NCHW forward: out = conv(x, wt) + bias (bias may be undefined).
template <typename T, typename Acc>
bool small_forward(const tile::ConvGeom& g, const at::Tensor& x, const at::Tensor& wt,
                   const at::Tensor& bias, at::Tensor& out, cudaStream_t stream);

// NCHW grad_input into gx (fully written): a small forward over grad_output
// at stride 1, a gather otherwise.
template <typename T, typename Acc>
bool small_grad_input(const tile::ConvGeom& g, const at::Tensor& go, const at::Tensor& wt,
                      at::Tensor& gx, cudaStream_t stream);

// NCHW grad_weight into gw (fully written): partial sums on the forward's
// blocks, then one pass adding them in order.
template <typename T, typename Acc>
bool small_grad_weight(const tile::ConvGeom& g, const at::Tensor& go, const at::Tensor& x,
                       at::Tensor& gw, cudaStream_t stream);

// channels_last depthwise (x, out, go, gx in [n, h, w, c] memory; wt and gw
// [c, 1, K, K] contiguous): forward, grad_input, grad_weight.
template <typename T, typename Acc>
bool nhwc_forward(const tile::ConvGeom& g, const at::Tensor& x, const at::Tensor& wt,
                  const at::Tensor& bias, at::Tensor& out, cudaStream_t stream);
template <typename T, typename Acc>
bool nhwc_grad_input(const tile::ConvGeom& g, const at::Tensor& go, const at::Tensor& wt,
                     at::Tensor& gx, cudaStream_t stream);
template <typename T, typename Acc>
bool nhwc_grad_weight(const tile::ConvGeom& g, const at::Tensor& go, const at::Tensor& x,
                      at::Tensor& gw, cudaStream_t stream);

}  // namespace ddpx::detail::cuda
