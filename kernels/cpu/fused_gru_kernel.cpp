// CPU kernels of ddpx::fused_gru, _fused_gru_forward and _fused_gru_backward:
// the shared sequence driver with the vectorized CPU gate step of ATen's CPU
// capability (AVX512, AVX2 or scalar lanes), split across the batch rows over
// at::parallel_for where the step is large enough to pay for it.
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

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

// Gate steps are split into tasks of whole batch rows, ~kTaskElems elements
// each: below that (small batch x hidden) one thread does the step, since
// waking the pool costs ~2-5 us on this machine's OpenMP and a 4K-element
// step takes ~4-5 us. Measured on T32 B64 H256 L2 (2 threads, perf): with the
// step serial the second OpenMP thread spun in libgomp for 65% of the CPU
// samples, with 4 tasks per step 54%; the tasks of 16K elements we also tried
// kept it serial there and were no faster. Task boundaries depend on batch and
// hidden only, never on the thread count, so the bias gradient sums come out
// the same with any number of threads.
constexpr int64_t kTaskElems = 4096;

int64_t rows_per_task(int64_t hidden) {
  return std::max<int64_t>(1, kTaskElems / std::max<int64_t>(hidden, 1));
}

// Rows [b0, b1) of a step: pointers moved by b0 rows, batch b1 - b0.
template <typename T>
GruForwardStep<T> rows(GruForwardStep<T> p, int64_t b0, int64_t b1) {
  p.batch = b1 - b0;
  p.x_proj += b0 * p.x_proj_stride;
  p.h_proj += b0 * p.h_proj_stride;
  p.h_prev += b0 * p.h_prev_stride;
  p.h_out += b0 * p.h_out_stride;
  if (p.gates != nullptr) p.gates += b0 * 4 * p.hidden;
  return p;
}

// The same for backward; bias_grad is the task's own [4*hidden] partial sum.
template <typename T>
GruBackwardStep<T> rows(GruBackwardStep<T> p, int64_t b0, int64_t b1, T* bias_partial) {
  const int64_t H = p.hidden;
  p.batch = b1 - b0;
  p.grad_out += b0 * p.grad_out_stride;
  p.dh += b0 * H;
  p.gates += b0 * 4 * H;
  p.h_prev += b0 * p.h_prev_stride;
  p.dx_proj += b0 * 3 * H;
  p.dh_proj += b0 * 3 * H;
  p.bias_grad = p.bias_grad != nullptr ? bias_partial : nullptr;
  return p;
}

template <typename T>
void forward_rows(void (*kernel)(const GruForwardStep<T>&), const GruForwardStep<T>& p) {
  const int64_t per = rows_per_task(p.hidden);
  if (p.batch <= per) return kernel(p);
  at::parallel_for(0, p.batch, per, [&](int64_t b0, int64_t b1) { kernel(rows(p, b0, b1)); });
}

template <typename T>
void backward_rows(void (*kernel)(const GruBackwardStep<T>&), const GruBackwardStep<T>& p) {
  const int64_t per = rows_per_task(p.hidden);
  if (p.batch <= per) return kernel(p);
  const int64_t tasks = (p.batch + per - 1) / per, H4 = 4 * p.hidden;
  // Per-task bias sums, reused across steps (the driver allocates nothing in
  // its time loop; neither do we after the first step).
  thread_local std::vector<T> partial;
  if (p.bias_grad != nullptr) partial.resize(tasks * H4);
  T* part = partial.data();
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      kernel(rows(p, t * per, std::min(p.batch, (t + 1) * per), part + t * H4));
    }
  });
  if (p.bias_grad == nullptr) return;
  std::copy(part, part + H4, p.bias_grad);
  for (int64_t t = 1; t < tasks; ++t) {
    for (int64_t j = 0; j < H4; ++j) p.bias_grad[j] += part[t * H4 + j];
  }
}

void forward_step(c10::ScalarType dtype, const GruForwardStep<void>& step) {
  if (dtype == at::kFloat) {
    forward_rows(cpu_gates().forward_f32, detail::typed<float>(step));
  } else {
    TORCH_INTERNAL_ASSERT(dtype == at::kDouble);
    forward_rows(cpu_gates().forward_f64, detail::typed<double>(step));
  }
}

void backward_step(c10::ScalarType dtype, const GruBackwardStep<void>& step) {
  if (dtype == at::kFloat) {
    backward_rows(cpu_gates().backward_f32, detail::typed<float>(step));
  } else {
    TORCH_INTERNAL_ASSERT(dtype == at::kDouble);
    backward_rows(cpu_gates().backward_f64, detail::typed<double>(step));
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

// How one time step's gate kernel runs for this input: "serial", or
// "batch-parallel:<tasks>" (the benchmark prints it per case).
std::string fused_gru_path_cpu(const at::Tensor& input, int64_t hidden_size, bool batch_first) {
  TORCH_CHECK(input.dim() == 2 || input.dim() == 3,
              "input must be 2-D [seq, input_size] (unbatched) or 3-D, got ", input.dim(), "-D");
  TORCH_CHECK(hidden_size > 0, "hidden_size must be positive, got ", hidden_size);
  const int64_t batch = input.dim() == 2 ? 1 : input.size(batch_first ? 0 : 1);
  const int64_t per = rows_per_task(hidden_size);
  if (batch <= per) return "serial";
  return "batch-parallel:" + std::to_string((batch + per - 1) / per);
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpx, CPU, m) {
  m.impl("fused_gru_path", &fused_gru_path_cpu);
  m.impl("fused_gru", &fused_gru_cpu);
  m.impl("_fused_gru_forward", &fused_gru_forward_cpu);
  m.impl("_fused_gru_backward", &fused_gru_backward_cpu);
}

}  // namespace ddpx
