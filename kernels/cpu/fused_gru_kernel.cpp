// CPU kernels of ddpx::fused_gru, _fused_gru_forward and _fused_gru_backward:
// the shared sequence driver with the vectorized CPU gate step of ATen's CPU
// capability (AVX512, AVX2 or scalar lanes).
#include <ATen/Version.h>
#include <torch/library.h>

#include "kernels/common/gru_sequence.h"
#include "kernels/cpu/fused_gru_gates.h"

namespace ddpx {
namespace {

using detail::GruBackwardStep;
using detail::GruCpuGates;
using detail::GruForwardStep;
using detail::GruOptions;

// ATEN_CPU_CAPABILITY=avx2 (or default) lowers ATen and us alike.
const GruCpuGates& cpu_gates() {
  static const GruCpuGates gates = [] {
    const std::string cap = at::get_cpu_capability();
    if (cap == "AVX512") return detail::gru_cpu_gates_avx512();
    if (cap == "AVX2") return detail::gru_cpu_gates_avx2();
    return detail::gru_cpu_gates_default();
  }();
  return gates;
}

void forward_step(c10::ScalarType dtype, const GruForwardStep<void>& step) {
  if (dtype == at::kFloat) {
    cpu_gates().forward_f32(detail::typed<float>(step));
  } else {
    TORCH_INTERNAL_ASSERT(dtype == at::kDouble);
    cpu_gates().forward_f64(detail::typed<double>(step));
  }
}

void backward_step(c10::ScalarType dtype, const GruBackwardStep<void>& step) {
  if (dtype == at::kFloat) {
    cpu_gates().backward_f32(detail::typed<float>(step));
  } else {
    TORCH_INTERNAL_ASSERT(dtype == at::kDouble);
    cpu_gates().backward_f64(detail::typed<double>(step));
  }
}

constexpr detail::GruStepKernels kCpuSteps{&forward_step, &backward_step,
                                           /*sums_bias_grads=*/true};

void check_cpu_dtype(const at::Tensor& input) {
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kDouble,
              "fused_gru on CPU supports float32 and float64 input, got ", input.scalar_type());
}

GruOptions options(bool has_biases, int64_t num_layers, double dropout, bool train,
                   bool bidirectional, bool batch_first) {
  return {has_biases, num_layers, dropout, train, bidirectional, batch_first};
}

std::tuple<at::Tensor, at::Tensor> fused_gru_cpu(const at::Tensor& input,
                                                 const std::optional<at::Tensor>& hx,
                                                 at::TensorList params, bool has_biases,
                                                 int64_t num_layers, double dropout, bool train,
                                                 bool bidirectional, bool batch_first) {
  check_cpu_dtype(input);
  auto r = detail::gru_sequence_forward(
      input, hx, params,
      options(has_biases, num_layers, dropout, train, bidirectional, batch_first),
      /*save=*/false, kCpuSteps);
  return {std::move(r.output), std::move(r.h_n)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_gru_forward_cpu(
    const at::Tensor& input, const std::optional<at::Tensor>& hx, at::TensorList params,
    bool has_biases, int64_t num_layers, double dropout, bool train, bool bidirectional,
    bool batch_first) {
  check_cpu_dtype(input);
  auto r = detail::gru_sequence_forward(
      input, hx, params,
      options(has_biases, num_layers, dropout, train, bidirectional, batch_first),
      /*save=*/true, kCpuSteps);
  return {std::move(r.output), std::move(r.h_n), std::move(r.gates), std::move(r.layer_outputs),
          std::move(r.dropout_masks)};
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> fused_gru_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& grad_hy, const at::Tensor& input,
    const std::optional<at::Tensor>& hx, at::TensorList params, const at::Tensor& output,
    const at::Tensor& gates, const at::Tensor& layer_outputs, const at::Tensor& dropout_masks,
    bool has_biases, int64_t num_layers, bool bidirectional, bool batch_first) {
  check_cpu_dtype(input);
  // Backward needs no dropout probability: the saved masks are the dropout.
  auto r = detail::gru_sequence_backward(
      grad_output, grad_hy, input, hx, params, output, gates, layer_outputs, dropout_masks,
      options(has_biases, num_layers, /*dropout=*/0.0, /*train=*/false, bidirectional, batch_first),
      kCpuSteps);
  return {std::move(r.grad_input), std::move(r.grad_hx), std::move(r.grad_params)};
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpx, CPU, m) {
  m.impl("fused_gru", &fused_gru_cpu);
  m.impl("_fused_gru_forward", &fused_gru_forward_cpu);
  m.impl("_fused_gru_backward", &fused_gru_backward_cpu);
}

}  // namespace ddpx
