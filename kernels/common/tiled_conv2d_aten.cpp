#include "kernels/common/tiled_conv2d_aten.h"

namespace ddpx::detail {

at::Tensor aten_conv2d_forward(const Conv2dShape& s, const at::Tensor& input,
                               const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               at::IntArrayRef stride, at::IntArrayRef padding,
                               at::IntArrayRef dilation, int64_t groups) {
  // ATen's output layout is the one we promise anyway. From the kernels
  // (below autograd) nothing is recorded; from the Autograd kernel, ATen
  // records its own backward node.
  const at::Tensor out =
      at::convolution(s.unbatched ? input.unsqueeze(0) : input, weight, bias, stride, padding,
                      dilation, /*transposed=*/false, /*output_padding=*/{0, 0}, groups);
  return s.unbatched ? out.squeeze(0) : out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aten_conv2d_backward(
    const Conv2dShape& s, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, std::array<bool, 3> output_mask) {
  auto batched = [&](const at::Tensor& t) { return s.unbatched ? t.unsqueeze(0) : t; };
  auto [gx, gw, gb] = at::convolution_backward(
      batched(grad_output), batched(input), weight,
      /*bias_sizes=*/
      output_mask[2] ? at::OptionalIntArrayRef(weight.sizes().slice(0, 1))
                     : at::OptionalIntArrayRef(),
      stride, padding, dilation, /*transposed=*/false, /*output_padding=*/{0, 0}, groups,
      output_mask);
  // ATen may hand back gradients nobody asked for (oneDNN computes grad_bias
  // with grad_weight); our contract is undefined for every unset mask entry.
  if (!output_mask[0]) gx = at::Tensor();
  if (!output_mask[1]) gw = at::Tensor();
  if (!output_mask[2]) gb = at::Tensor();
  if (gx.defined() && s.unbatched) gx = gx.squeeze(0);
  return {gx, gw, gb};
}

}  // namespace ddpx::detail
