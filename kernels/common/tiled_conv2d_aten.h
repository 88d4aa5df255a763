#pragma once
// The `aten` path of ddpx::tiled_conv2d, on any device: at::convolution and
// at::convolution_backward (oneDNN on the CPU, cuDNN on CUDA) with our op's
// contract (a 3-D input stays 3-D; a gradient whose output_mask entry is
// unset is undefined). Called by the CPU and CUDA kernels where the path
// rules (kernels/cpu/tiled_conv2d_path.h, tiled_conv2d_cuda_path.h) choose it.
#include <ATen/ATen.h>

#include <array>
#include <tuple>

#include "kernels/common/tiled_conv2d_args.h"

namespace ddpx::detail {

at::Tensor aten_conv2d_forward(const Conv2dShape& s, const at::Tensor& input,
                               const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               at::IntArrayRef stride, at::IntArrayRef padding,
                               at::IntArrayRef dilation, int64_t groups);

std::tuple<at::Tensor, at::Tensor, at::Tensor> aten_conv2d_backward(
    const Conv2dShape& s, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, std::array<bool, 3> output_mask);

}  // namespace ddpx::detail
