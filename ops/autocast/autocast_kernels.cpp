// Autocast kernels for tiled_conv2d and fused_gru (torch.autocast /
// at::autocast). Without them the ops fell through autocast, so their own
// CPU/CUDA code saw the caller's float32 tensors, but the ATen calls inside
// (cuDNN's convolution and GRU, which serve most CUDA cases) went through
// autocast again and came back in bfloat16: the next layer then got a
// bfloat16 input with a float32 weight and failed (`ddpx-train --amp bf16`
// on the H200, 2026-11-28).
//
// The policy follows ATen's for conv2d, as far as our kernels go:
//  - CUDA: floating inputs are cast to autocast's dtype (float16 or
//    bfloat16; both are computed there), as F.conv2d's are. (nn.GRU's are
//    not: ATen's cuDNN RNN autocast casts to float16 whatever the dtype,
//    aten/src/ATen/cudnn/AutocastRNN.cpp; fused_gru keeps the one asked for,
//    whose range is what a bfloat16 run chose.)
//  - CPU: our kernels compute float32 and float64 only, so floating inputs
//    run in float32 (an op on autocast's fp32 list); float64 stays float64.
// In both, autocast is off inside the op, so its ATen calls keep that dtype.
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <ddpx/ops.h>
#include <torch/library.h>

#include <string>

namespace ddpx {
namespace {

template <c10::DeviceType kDevice>
at::ScalarType autocast_dtype() {
  return kDevice == c10::DeviceType::CUDA
             ? at::autocast::get_lower_precision_fp_from_device_type(kDevice)
             : at::kFloat;
}

template <c10::DeviceType kDevice>
std::optional<at::Tensor> autocast_optional(const std::optional<at::Tensor>& t) {
  return at::autocast::cached_cast(autocast_dtype<kDevice>(), t, kDevice);
}

template <c10::DeviceType kDevice>
at::Tensor tiled_conv2d_autocast(const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                 at::IntArrayRef padding, at::IntArrayRef dilation,
                                 int64_t groups) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  const auto dtype = autocast_dtype<kDevice>();
  return ddpx::tiled_conv2d(at::autocast::cached_cast(dtype, input, kDevice),
                            at::autocast::cached_cast(dtype, weight, kDevice),
                            autocast_optional<kDevice>(bias), stride, padding, dilation, groups);
}

// ATen warns on every cuDNN RNN call whose weights are not views of one
// buffer in cuDNN's layout ("... not part of single contiguous chunk of
// memory"), and copies them into one. Weights cast here never are (each is
// cast on its own; ATen's own RNN autocast casts into such a buffer, with
// internals we cannot call), so under autocast that warning is about our
// casts, not the user's model, and a C++ trainer would print it on every
// call: dropped, every other warning passed on.
class DropRnnLayoutWarning : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("not part of single contiguous chunk") != std::string::npos) return;
    prev_->process(warning);
  }

 private:
  c10::WarningHandler* prev_ = c10::WarningUtils::get_warning_handler();
};

template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor> fused_gru_autocast(const at::Tensor& input,
                                                      const std::optional<at::Tensor>& hx,
                                                      at::TensorList params, bool has_biases,
                                                      int64_t num_layers, double dropout,
                                                      bool train, bool bidirectional,
                                                      bool batch_first) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  const auto dtype = autocast_dtype<kDevice>();
  std::vector<at::Tensor> cast_params;
  cast_params.reserve(params.size());
  for (const auto& p : params) cast_params.push_back(at::autocast::cached_cast(dtype, p, kDevice));
  DropRnnLayoutWarning drop;
  const c10::WarningUtils::WarningHandlerGuard quiet(&drop);
  return ddpx::fused_gru(at::autocast::cached_cast(dtype, input, kDevice),
                         autocast_optional<kDevice>(hx), cast_params, has_biases, num_layers,
                         dropout, train, bidirectional, batch_first);
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpx, AutocastCUDA, m) {
  m.impl("tiled_conv2d", TORCH_FN(tiled_conv2d_autocast<c10::DeviceType::CUDA>));
  m.impl("fused_gru", TORCH_FN(fused_gru_autocast<c10::DeviceType::CUDA>));
}

TORCH_LIBRARY_IMPL(ddpx, AutocastCPU, m) {
  m.impl("tiled_conv2d", TORCH_FN(tiled_conv2d_autocast<c10::DeviceType::CPU>));
  m.impl("fused_gru", TORCH_FN(fused_gru_autocast<c10::DeviceType::CPU>));
}

}  // namespace ddpx
