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
// kernels keep the recurrent weights on chip. Nowhere did ours win by more
// than the noise (3%), so on CUDA the rule is cuDNN for every shape. Our own
// persistent kernels (kernels/cuda/gru_persistent_kernel.cu) came after that
// run and have not run on a GPU: they serve DDPX_GRU_PATH=fused until their
// measurements say where the rule should pick them.
// DDPX_GRU_PATH (read on every call): auto (or unset), cudnn; fused (ours:
// persistent where its plan fits the device, else per step); step (ours, per
// step: the tests' and the benchmark's second column); benchmark (cuDNN or
// ours measured per problem, ops/fused_gru_tune.h; also `auto` with
// torch.backends.cudnn.benchmark set).
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace ddpx::detail {

enum class GruCudaPath { kCudnn, kFused, kStep, kBenchmark };

// DDPX_GRU_PATH's choice (an error naming the variable for any other value).
GruCudaPath gru_cuda_path_choice();

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
