#pragma once
// Which implementation serves ddpx::fused_gru on CUDA: our kernels
// (kernels/cuda/fused_gru_kernel.cu, `fused`) or cuDNN's GRU through at::gru
// (`cudnn`), as the CPU side picks its gate split per shape.
//
// Measured on a lent H100 (bench_results/gpu/2026-11-27-h100/gru-cuda.json:
// torch 2.11 + cuDNN 9, float32 with TF32 off on both sides, forward +
// backward of the input and every weight, device events around back-to-back
// calls), ours / torch.nn.GRU:
//
//   hidden 64  (T 32..128, B 16..64, 1..2 layers)   2.1 - 8.6
//   hidden 256 (T 32..128, B 16..64, 1..2 layers)   0.97 - 1.21
//
// Our kernel then launched per time step and layer; cuDNN's persistent RNN
// kernels keep the recurrent weights on chip. Our own persistent kernels
// (kernels/cuda/gru_persistent_kernel.cu, the whole recurrence in one launch
// per layer and pass) first ran on a lent H200
// (bench_results/gpu/2026-11-30-h200/gru-cuda.json, same method, T 32..512,
// 1..2 layers, one- and bidirectional), ours alone / torch.nn.GRU:
//
//   batch 1..4,  hidden 128..1024                   0.40 - 0.68
//   batch 16,    hidden 256..512                    0.53 - 0.77
//   batch 16,    hidden 1024                        1.23 - 1.31
//   batch 64,    hidden 64..1024                    1.49 - 2.34
//   hidden 64,   batch 1 / 16 / 16 bidirectional    0.95 / 1.39 / 0.69
//
// So `auto` runs ours where gru_persistent_beats_cudnn says (float32, the
// persistent plan fitting the device) and cuDNN elsewhere. Measured with
// TF32 off; with cuDNN's TF32 on (PyTorch's default), which speeds its GEMMs
// up, ours keeps only batch <= 4, where each step is a matrix-vector product
// bound by latency, not by the multiply rate (inferred, not yet measured:
// scripts/device/check.sh's grufull group has the TF32 run). Half precision
// was not measured: cuDNN. Nor were forward-only calls (inference: the same
// rule) or sequences under 32 steps: under 16, where the launches per step
// that ours saves are few, cuDNN.
// DDPX_GRU_PATH (read on every call): auto (or unset); cudnn; fused (ours:
// persistent where its plan fits the device, else per step); step (ours, per
// step: the tests' and the benchmark's second column); benchmark (cuDNN or
// ours measured per problem, ops/fused_gru_tune.h; also `auto` with
// torch.backends.cudnn.benchmark set).
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace ddpx::detail {

enum class GruCudaPath { kAuto, kCudnn, kFused, kStep, kBenchmark };

// DDPX_GRU_PATH's choice (an error naming the variable for any other value).
GruCudaPath gru_cuda_path_choice();

// The measured rule above: whether our persistent kernel beats cuDNN's GRU
// for this problem (`tf32`: cuDNN's RNN may use TF32).
bool gru_persistent_beats_cudnn(int64_t hidden, int64_t batch, int64_t steps,
                                c10::ScalarType dtype, bool tf32);

// What `auto` runs for this problem: kFused (our persistent kernel: the rule
// says it wins and its plan fits the device) or kCudnn.
GruCudaPath gru_auto_path(const at::Tensor& input, int64_t hidden, bool batch_first);

// Whether the persistent plan fits `device` for the problem.
// libddpx_cuda.so installs the query when it loads; without it the answer is no.
void set_gru_persistent_query(bool (*query)(int device, int64_t hidden, int64_t batch,
                                            c10::ScalarType dtype));

// Whether the current stream of `device` is being captured into a CUDA
// graph (no syncs allowed, so nothing is measured). libddpx_cuda.so installs
// the query when it loads; without it the answer is no.
bool gru_stream_capturing(c10::Device device);
void set_gru_stream_capture_query(bool (*query)(c10::Device));

// fused_gru's contract through at::gru: an unbatched input stays unbatched,
// hx None means zeros. Called with autograd on, ATen records its own
// backward (and its dropout masks).
std::tuple<at::Tensor, at::Tensor> gru_through_cudnn(const at::Tensor& input,
                                                     const std::optional<at::Tensor>& hx,
                                                     at::TensorList params, bool has_biases,
                                                     int64_t num_layers, double dropout, bool train,
                                                     bool bidirectional, bool batch_first);

}  // namespace ddpx::detail
