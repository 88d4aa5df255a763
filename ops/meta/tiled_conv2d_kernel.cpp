// Meta (shape-only) kernels of ddpx::tiled_conv2d and its backward: what
// torch.compile's fake tensors run. Same checks as the real kernels, same
// output shapes and memory formats, sizes kept symbolic.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "kernels/common/tiled_conv2d_args.h"

namespace ddpx::detail {
namespace {

at::Tensor tiled_conv2d_meta(const at::Tensor& input, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                             at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  const Conv2dShape s =
      check_tiled_conv2d_args(input, weight, bias, stride, padding, dilation, groups);
  if (s.unbatched) return at::empty_symint({s.c_out, s.oh, s.ow}, input.options());
  return at::empty_symint(
      {s.n, s.c_out, s.oh, s.ow},
      input.options().memory_format(conv2d_output_memory_format(input, weight)));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tiled_conv2d_backward_meta(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    std::array<bool, 3> output_mask) {
  const Conv2dShape s = check_tiled_conv2d_backward_args(grad_output, input, weight, stride,
                                                         padding, dilation, groups);
  const auto fmt = conv2d_output_memory_format(input, weight);
  at::Tensor gi, gw, gb;
  if (output_mask[0]) {
    gi = at::empty_symint(input.sym_sizes(), input.options().memory_format(
                                                 s.unbatched ? at::MemoryFormat::Contiguous : fmt));
  }
  if (output_mask[1])
    gw = at::empty_symint(weight.sym_sizes(), weight.options().memory_format(fmt));
  if (output_mask[2]) gb = at::empty_symint({s.c_out}, grad_output.options());
  return {gi, gw, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpx, Meta, m) {
  m.impl("tiled_conv2d", TORCH_FN(tiled_conv2d_meta));
  m.impl("_tiled_conv2d_backward", TORCH_FN(tiled_conv2d_backward_meta));
}

}  // namespace ddpx::detail
