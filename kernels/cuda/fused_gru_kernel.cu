// CUDA kernels of ddpx::fused_gru, _fused_gru_forward and _fused_gru_backward:
// the shared sequence driver (GEMMs through ATen, i.e. cuBLAS) with, per
// layer and direction, the persistent recurrence (gru_persistent_kernel.cu)
// where its plan fits the device, else a fused gate step of one thread per
// [batch, hidden] element per time step; the per-element math is
// kernels/common/gru_cell.h, computed in float for half and bfloat16. Also
// fused_gru_path on CUDA.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/cudnn_is_acceptable.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/common/gru_cell.h"
#include "kernels/common/gru_sequence.h"
#include "kernels/cuda/gru_persistent_launch.h"
#include "ops/fused_gru_cuda_path.h"
#include "ops/fused_gru_tune.h"

namespace ddpx {
namespace {

using detail::GruBackwardStep;
using detail::GruForwardStep;
using detail::GruOptions;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

template <typename T, typename Acc>
__global__ void __launch_bounds__(kThreads) gru_forward_step_kernel(GruForwardStep<T> p) {
  const int64_t n = p.batch * p.hidden;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const detail::GruElement e = detail::gru_element(i, p.hidden);
    detail::gru_step_forward_element<T, Acc>(p, e.row, e.col);
  }
}

template <typename T, typename Acc>
__global__ void __launch_bounds__(kThreads) gru_backward_step_kernel(GruBackwardStep<T> p) {
  const int64_t n = p.batch * p.hidden;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const detail::GruElement e = detail::gru_element(i, p.hidden);
    detail::gru_step_backward_element<T, Acc>(p, e.row, e.col);
  }
}

// The device guard is set by the op entry; each step runs on the current stream.
void forward_step(c10::ScalarType dtype, const GruForwardStep<void>& step) {
  const int64_t n = step.batch * step.hidden;
  if (n == 0) return;
  const int blocks = static_cast<int>(detail::gru_grid_blocks(n, kThreads, kMaxBlocks));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fused_gru_forward_step", [&] {
    gru_forward_step_kernel<scalar_t, at::opmath_type<scalar_t>>
        <<<blocks, kThreads, 0, stream>>>(detail::typed<scalar_t>(step));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void backward_step(c10::ScalarType dtype, const GruBackwardStep<void>& step) {
  const int64_t n = step.batch * step.hidden;
  if (n == 0) return;
  const int blocks = static_cast<int>(detail::gru_grid_blocks(n, kThreads, kMaxBlocks));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fused_gru_backward_step", [&] {
    gru_backward_step_kernel<scalar_t, at::opmath_type<scalar_t>>
        <<<blocks, kThreads, 0, stream>>>(detail::typed<scalar_t>(step));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// Bias gradients: one at::sum over the sequence afterwards (cheap on a GPU).
constexpr detail::GruStepKernels kCudaSteps{&forward_step, &backward_step,
                                            /*sums_bias_grads=*/false};
constexpr detail::GruStepKernels kCudaPersistent{
    &forward_step, &backward_step, /*sums_bias_grads=*/false, &detail::gru_persistent_forward,
    &detail::gru_persistent_backward};

// DDPX_GRU_PATH=step keeps our kernels per step (the autograd kernel has
// already sent the call here rather than to cuDNN).
const detail::GruStepKernels& cuda_kernels() {
  return detail::gru_cuda_path_choice() == detail::GruCudaPath::kStep ? kCudaSteps
                                                                      : kCudaPersistent;
}

void check_cuda_dtype(const at::Tensor& input) {
  const auto t = input.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16,
              "fused_gru on CUDA supports float32, float64, float16 and bfloat16 input, got ", t);
}

std::tuple<at::Tensor, at::Tensor> fused_gru_cuda(const at::Tensor& input,
                                                  const std::optional<at::Tensor>& hx,
                                                  at::TensorList params, bool has_biases,
                                                  int64_t num_layers, double dropout, bool train,
                                                  bool bidirectional, bool batch_first) {
  const c10::cuda::CUDAGuard guard(input.device());
  check_cuda_dtype(input);
  const GruOptions opt{has_biases, num_layers, dropout, train, bidirectional, batch_first};
  const auto ours = [&]() -> std::tuple<at::Tensor, at::Tensor> {
    auto r = detail::gru_sequence_forward(input, hx, params, opt, /*save=*/false, cuda_kernels());
    return {std::move(r.output), std::move(r.h_n)};
  };
  // Inference (the Autograd kernel's no-grad calls, and torch.inference_mode,
  // which skips that kernel): the path is chosen here, as there for training.
  // (Below autograd: ATen's GRU records nothing.)
  return detail::gru_on_cuda_path(input, hx, params, has_biases, num_layers, dropout, train,
                                  bidirectional, batch_first, /*grad=*/false, ours);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_gru_forward_cuda(
    const at::Tensor& input, const std::optional<at::Tensor>& hx, at::TensorList params,
    bool has_biases, int64_t num_layers, double dropout, bool train, bool bidirectional,
    bool batch_first) {
  const c10::cuda::CUDAGuard guard(input.device());
  check_cuda_dtype(input);
  const GruOptions opt{has_biases, num_layers, dropout, train, bidirectional, batch_first};
  auto r = detail::gru_sequence_forward(input, hx, params, opt, /*save=*/true, cuda_kernels());
  return {std::move(r.output), std::move(r.h_n), std::move(r.gates), std::move(r.layer_outputs),
          std::move(r.dropout_masks)};
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> fused_gru_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& grad_hy, const at::Tensor& input,
    const std::optional<at::Tensor>& hx, at::TensorList params, const at::Tensor& output,
    const at::Tensor& gates, const at::Tensor& layer_outputs, const at::Tensor& dropout_masks,
    bool has_biases, int64_t num_layers, bool bidirectional, bool batch_first) {
  const c10::cuda::CUDAGuard guard(input.device());
  check_cuda_dtype(input);
  // Backward needs no dropout probability: the saved masks are the dropout.
  const GruOptions opt{has_biases,      num_layers,    /*dropout=*/0.0,
                       /*train=*/false, bidirectional, batch_first};
  auto r = detail::gru_sequence_backward(grad_output, grad_hy, input, hx, params, output, gates,
                                         layer_outputs, dropout_masks, opt, cuda_kernels());
  return {std::move(r.grad_input), std::move(r.grad_hx), std::move(r.grad_params)};
}

// "cudnn", "aten", "persistent" (ours, the whole recurrence per launch),
// "step" or "benchmark".
std::string fused_gru_path_cuda(const at::Tensor& input, int64_t hidden_size, bool batch_first) {
  TORCH_CHECK(input.dim() == 2 || input.dim() == 3,
              "input must be 2-D [seq, input_size] (unbatched) or 3-D, got ", input.dim(), "-D");
  TORCH_CHECK(hidden_size > 0, "hidden_size must be positive, got ", hidden_size);
  const detail::GruCudaPath choice = detail::gru_cuda_path_choice();
  // at::gru runs cuDNN's RNN where ATen's own test lets it (cuDNN enabled;
  // float32, float64 or float16; not empty); otherwise ATen's GRU of
  // per-step kernels: bfloat16, or torch.backends.cudnn.enabled = False.
  if (choice == detail::GruCudaPath::kCudnn ||
      (choice == detail::GruCudaPath::kAuto &&
       detail::gru_auto_path(input, hidden_size, batch_first) == detail::GruCudaPath::kCudnn)) {
    return at::cudnn_is_acceptable(input) ? "cudnn" : "aten";
  }
  if (choice == detail::GruCudaPath::kStep) return "step";
  // (measured per problem, which this query does not name in full)
  if (choice == detail::GruCudaPath::kBenchmark) return "benchmark";
  const int64_t batch = input.dim() == 2 ? 1 : input.size(batch_first ? 0 : 1);
  const bool persistent =
      batch > 0 &&
      detail::gru_persistent_serves(input.get_device(), hidden_size, batch, input.scalar_type());
  return persistent ? "persistent" : "step";
}

// Benchmark mode measures nothing while a CUDA graph is being captured.
bool capturing(c10::Device device) {
  const c10::cuda::CUDAGuard guard(device);
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}
[[maybe_unused]] const bool capture_query_installed = [] {
  detail::set_gru_stream_capture_query(&capturing);
  detail::set_gru_persistent_query(&detail::gru_persistent_serves);
  return true;
}();

}  // namespace

TORCH_LIBRARY_IMPL(ddpx, CUDA, m) {
  m.impl("fused_gru_path", &fused_gru_path_cuda);
  m.impl("fused_gru", &fused_gru_cuda);
  m.impl("_fused_gru_forward", &fused_gru_forward_cuda);
  m.impl("_fused_gru_backward", &fused_gru_backward_cuda);
}

}  // namespace ddpx
