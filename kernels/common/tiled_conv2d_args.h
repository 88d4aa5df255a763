#pragma once
// Argument checks and output-shape rules of ddpx::tiled_conv2d, shared by every
// backend kernel (CPU, CUDA, Meta). The dispatcher may enter any of them
// directly (torch.ops.ddpx.tiled_conv2d from Python goes straight to the
// Autograd/CPU/CUDA/Meta kernel), so each one checks at its own door with this
// one function; the messages therefore read the same on every backend.
//
// Sizes are c10::SymInt so the Meta kernel works under torch.compile with
// dynamic shapes; on real tensors they are plain integers.
#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <array>
#include <optional>
#include <string>

#include "kernels/common/conv_tile.h"

namespace ddpx::detail {

// The resolved geometry of one (batched, 4-D) convolution.
struct Conv2dShape {
  c10::SymInt n, c_in, h, w;        // input  [n, c_in, h, w]
  c10::SymInt c_out, kh, kw;        // weight [c_out, c_in / groups, kh, kw]
  c10::SymInt oh, ow;               // output [n, c_out, oh, ow]
  std::array<int64_t, 2> stride{};  // (vertical, horizontal), each >= 1
  std::array<int64_t, 2> padding{};
  std::array<int64_t, 2> dilation{};
  int64_t groups = 1;
  bool unbatched = false;  // the caller passed a 3-D [c_in, h, w] input
  // The output's memory format (conv2d_output_memory_format): the kernels
  // and their speeds differ by layout (benchmark mode measures each apart).
  at::MemoryFormat layout = at::MemoryFormat::Contiguous;
};

// The geometry as plain integers (concrete sizes only), as the kernels, the
// CUDA path rule and the CPU paths work with it.
tile::ConvGeom conv_geom(const Conv2dShape& s);

// Checks every argument of tiled_conv2d (one TORCH_CHECK per condition, each
// naming the argument) and returns the geometry.
Conv2dShape check_tiled_conv2d_args(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                    at::IntArrayRef padding, at::IntArrayRef dilation,
                                    int64_t groups);

// Checks the extra arguments of _tiled_conv2d_backward: grad_output must have
// the forward output's shape, dtype and device.
Conv2dShape check_tiled_conv2d_backward_args(const at::Tensor& grad_output, const at::Tensor& input,
                                             const at::Tensor& weight, at::IntArrayRef stride,
                                             at::IntArrayRef padding, at::IntArrayRef dilation,
                                             int64_t groups);

// The memory format ATen's conv2d gives its output: channels-last when the
// input or the weight suggests it (ATen's mkldnn/thnn/cudnn rule), else
// contiguous. Unbatched inputs always give a contiguous output.
at::MemoryFormat conv2d_output_memory_format(const at::Tensor& input, const at::Tensor& weight);

// Whether `dtype` is computed by the backend on `device_type`.
bool tiled_conv2d_dtype_supported(c10::DeviceType device_type, at::ScalarType dtype);

// Whether ATen's convolution computes problem `s` as a convolution: not when
// the input has no channels (at::convolution then returns zero output
// channels, and its backward a zero grad_bias) nor an empty plane with
// padding around it (it rejects that). Our kernels compute both (the bias, or
// the padding's zeros, plus the bias), so every path choice keeps these off
// ATen: the answer never depends on the path. (A symbolic size counts as
// non-zero.)
bool aten_computes(const Conv2dShape& s);

// DDPX_CONV_PATH, read on every call (tests switch it): "auto" when unset or
// empty, else one of benchmark (measured per problem: conv_path_tuner.h),
// tiled, direct, gemm, aten (anything else is an error). The CPU's and CUDA's
// path rules both take it.
std::string conv_path_override();

}  // namespace ddpx::detail
