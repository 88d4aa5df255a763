// ddpx::tiled_conv2d: schemas of the op and of its backward, and the C++ entry
// that calls through the dispatcher (so C++ callers get autograd and device
// dispatch). Kernels: kernels/cpu, kernels/cuda, ops/autograd, ops/meta.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ddpx/ops.h>
#include <torch/library.h>

namespace ddpx {

at::Tensor tiled_conv2d(const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                        at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::tiled_conv2d", "")
                       .typed<decltype(tiled_conv2d)>();
  return op.call(input, weight, bias, stride, padding, dilation, groups);
}

std::string tiled_conv2d_path(const at::Tensor& input, const at::Tensor& weight,
                              at::IntArrayRef stride, at::IntArrayRef padding,
                              at::IntArrayRef dilation, int64_t groups) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::tiled_conv2d_path", "")
                       .typed<decltype(tiled_conv2d_path)>();
  return op.call(input, weight, stride, padding, dilation, groups);
}

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  m.def(
      "tiled_conv2d(Tensor input, Tensor weight, Tensor? bias=None, int[2] stride=1, "
      "int[2] padding=0, int[2] dilation=1, int groups=1) -> Tensor");
  // grad_input, grad_weight, grad_bias; an entry whose output_mask is false is
  // not computed and comes back undefined (None in Python).
  m.def(
      "_tiled_conv2d_backward(Tensor grad_output, Tensor input, Tensor weight, int[2] stride, "
      "int[2] padding, int[2] dilation, int groups, bool[3] output_mask) -> (Tensor, Tensor, "
      "Tensor)");
  // The algorithm tiled_conv2d uses for these arguments on input's device
  // ("direct", "gemm" or "aten" on CPU; "<forward>/<backward>" when the two
  // passes differ): the benchmark prints it per case.
  m.def(
      "tiled_conv2d_path(Tensor input, Tensor weight, int[2] stride=1, int[2] padding=0, "
      "int[2] dilation=1, int groups=1) -> str");
}

}  // namespace ddpx
