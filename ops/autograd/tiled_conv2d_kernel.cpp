// Autograd kernels of ddpx::tiled_conv2d (C++ programs have no Python, so
// autograd is registered here, not in Python). The backward is the registered
// op ddpx::_tiled_conv2d_backward; differentiating that again is not
// supported and says so.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ddpx/ops.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <tuple>
#include <vector>

#include "kernels/common/tiled_conv2d_args.h"
#include "kernels/common/tiled_conv2d_aten.h"
#include "kernels/common/tiled_conv2d_cuda_path.h"
#include "kernels/cpu/tiled_conv2d_path.h"

namespace ddpx::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    std::array<bool, 3> output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::_tiled_conv2d_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                           at::IntArrayRef, at::IntArrayRef, int64_t, std::array<bool, 3>)>();
  return op.call(grad_output, input, weight, stride, padding, dilation, groups, output_mask);
}

class TiledConv2dFunction : public torch::autograd::Function<TiledConv2dFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->saved_data["stride"] = stride.vec();
    ctx->saved_data["padding"] = padding.vec();
    ctx->saved_data["dilation"] = dilation.vec();
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->save_for_backward({input, weight});
    return ddpx::tiled_conv2d(input, weight, bias, stride, padding, dilation, groups);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto stride = ctx->saved_data["stride"].toIntVector();
    const auto padding = ctx->saved_data["padding"].toIntVector();
    const auto dilation = ctx->saved_data["dilation"].toIntVector();
    const int64_t groups = ctx->saved_data["groups"].toInt();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                   has_bias && ctx->needs_input_grad(2)};
    at::Tensor grad_output = grad_outputs[0];
    if (!grad_output.defined())
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
              at::Tensor(), at::Tensor(), at::Tensor()};
    auto [gi, gw, gb] =
        call_backward(grad_output, saved[0], saved[1], stride, padding, dilation, groups, mask);
    return {gi, gw, gb, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Wraps the backward op so that asking for its gradient (double backward)
// fails with a clear message instead of silently returning nothing.
class TiledConv2dBackwardFunction : public torch::autograd::Function<TiledConv2dBackwardFunction> {
 public:
  // Returns only the gradients that output_mask asked for (autograd cannot
  // wrap undefined outputs); the caller puts them back in their slots.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad_output,
                               const at::Tensor& input, const at::Tensor& weight,
                               at::IntArrayRef stride, at::IntArrayRef padding,
                               at::IntArrayRef dilation, int64_t groups,
                               std::array<bool, 3> output_mask) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [gi, gw, gb] =
        call_backward(grad_output, input, weight, stride, padding, dilation, groups, output_mask);
    variable_list defined;
    for (auto& t : {gi, gw, gb}) {
      if (t.defined()) defined.push_back(t);
    }
    return defined;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    TORCH_CHECK(false,
                "double backward of ddpx::tiled_conv2d is not supported (the gradient of "
                "ddpx::_tiled_conv2d_backward is not implemented); use "
                "torch.nn.functional.conv2d for higher-order gradients");
  }
};

at::Tensor tiled_conv2d_autograd(const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                 at::IntArrayRef padding, at::IntArrayRef dilation,
                                 int64_t groups) {
  const bool records = at::GradMode::is_enabled() &&
                       (input.requires_grad() || weight.requires_grad() ||
                        (bias.has_value() && bias->defined() && bias->requires_grad()));
  // Where ATen serves the passes that will run on the CPU (the forward, and
  // the backward when autograd records), call at::convolution with autograd
  // on: its own backward node replaces our Function and backward op (the
  // same two ATen kernels, less overhead: 2-4% on LeNet conv2 at batch 64
  // and on 3x3 depthwise), its double backward works, and inference skips
  // our CPU kernel's second trip through the dispatcher. Symbolic sizes
  // (torch.compile with dynamic shapes) keep the registered path.
  const bool concrete = !input.unsafeGetTensorImpl()->has_symbolic_sizes_strides() &&
                        !weight.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
  // The same on CUDA, where cuDNN serves (kernels/common/tiled_conv2d_cuda_path.h).
  // In benchmark mode a pass not measured yet is not known to be ATen's, so
  // its first calls take our Function, whose kernels measure.
  if (concrete && (input.device().is_cpu() || input.device().is_cuda())) {
    const Conv2dShape s =
        check_tiled_conv2d_args(input, weight, bias, stride, padding, dilation, groups);
    const auto dtype = input.scalar_type();
    const auto aten = [&](bool backward) {
      return input.device().is_cpu()
                 ? cpu::aten_serves(s, dtype,
                                    backward ? cpu::ConvPass::kBackward : cpu::ConvPass::kForward)
                 : cuda::aten_serves(s, input.device(), dtype,
                                     backward ? cuda::Pass::kBackward : cuda::Pass::kForward);
    };
    if (aten(false) && (!records || aten(true))) {
      return aten_conv2d_forward(s, input, weight, bias, stride, padding, dilation, groups);
    }
  }
  // Inference otherwise: nothing to record, so no Function (its node and
  // saved arguments cost ~25 us a call: LeNet conv1's forward at batch 64
  // measured 1.09x F.conv2d's with it).
  if (!records) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return ddpx::tiled_conv2d(input, weight, bias, stride, padding, dilation, groups);
  }
  return TiledConv2dFunction::apply(input, weight, bias, stride, padding, dilation, groups);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tiled_conv2d_backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    std::array<bool, 3> output_mask) {
  // The usual call: autograd's engine running tiled_conv2d's backward, with
  // grad mode off (no create_graph). Nothing is recorded then, so skip the
  // Function wrapper (its node and output wrapping: ~20 us of CPU a call
  // under torch.profiler on LeNet conv2 at batch 64) and go straight to the
  // kernel.
  const bool records =
      at::GradMode::is_enabled() &&
      (grad_output.requires_grad() || input.requires_grad() || weight.requires_grad());
  if (!records) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_backward(grad_output, input, weight, stride, padding, dilation, groups,
                         output_mask);
  }
  auto r = TiledConv2dBackwardFunction::apply(grad_output, input, weight, stride, padding, dilation,
                                              groups, output_mask);
  std::array<at::Tensor, 3> out;
  size_t next = 0;
  for (size_t i = 0; i < 3; ++i) {
    if (output_mask[i]) out[i] = r.at(next++);
  }
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpx, Autograd, m) {
  m.impl("tiled_conv2d", TORCH_FN(tiled_conv2d_autograd));
  m.impl("_tiled_conv2d_backward", TORCH_FN(tiled_conv2d_backward_autograd));
}

}  // namespace ddpx::detail
