#pragma once
// Benchmark mode for ddpx::fused_gru on CUDA, as kernels/common/conv_path_tuner.h
// is for tiled_conv2d and torch.backends.cudnn.benchmark for cuDNN's
// algorithms: the first call of a problem runs cuDNN's GRU and ours on the
// caller's own tensors (forward, and backward too when the call records
// autograd: the training step is what the choice is for), keeps the faster,
// and every later call of that problem takes it.
//
// Why: the fixed rule (ops/fused_gru_cuda_path.h) cannot know where our
// persistent kernels beat cuDNN on a card it was not drawn from; measuring
// on the card that trains cannot lose by more than the measurement's noise.
//
// On when DDPX_GRU_PATH=benchmark, or when it is unset or `auto` and
// torch.backends.cudnn.benchmark is set. The measuring call runs each
// candidate a few times, with device syncs (and, with dropout in training,
// draws more random numbers than one call would); under CUDA graph capture
// (no syncs allowed) a problem not measured yet takes the fixed rule.
// Choices are kept per problem for the life of the process, with
// tiled_conv2d's (conv_path_tuning_clear forgets both).
#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/common/conv_path_tuner.h"

namespace ddpx::detail {

using GruOutputs = std::tuple<at::Tensor, at::Tensor>;  // (output, h_n)

// What identifies one measured choice: device, dtype, the input's sizes and
// layout, hidden size, layers, directions, biases, dropout in training,
// whether the call records autograd, and the TF32 settings of cuDNN's RNN
// (cuDNN's speed) and of cuBLAS (our input projections' GEMMs).
ConvTuneKey gru_tune_key(const at::Tensor& input, at::TensorList params, bool has_biases,
                         int64_t num_layers, bool dropout_active, bool bidirectional,
                         bool batch_first, bool grad);

// Measures candidates 0..count-1 (run(i) returns their (output, h_n), with
// autograd recorded when `grad_inputs` is not empty; then each timed call
// also runs the backward into those tensors with torch::autograd::grad,
// keeping the graph, so the returned outputs' own backward still works and
// nothing is accumulated into .grad), remembers the fastest for `key` and
// returns its outputs from its last timed call.
GruOutputs gru_tune(const ConvTuneKey& key, c10::Device device, int count,
                    const std::function<GruOutputs(int)>& run,
                    const std::vector<at::Tensor>& grad_inputs);

// One fused_gru call on CUDA, by the path DDPX_GRU_PATH and benchmark mode
// choose (ops/fused_gru_cuda_path.h): cuDNN's GRU through at::gru, `ours`, or
// the faster of the two as measured for its problem, measured now on this
// call when it has not been. `grad`: the call records autograd (ATen's GRU
// then records its own backward; each timed call runs the backward into the
// tensors that require grad). Where nothing can be timed -- CUDA graph
// capture (no syncs), tensors being traced (torch.compile's fake or
// functional tensors, symbolic sizes) -- the fixed rule's cuDNN.
GruOutputs gru_on_cuda_path(const at::Tensor& input, const std::optional<at::Tensor>& hx,
                            at::TensorList params, bool has_biases, int64_t num_layers,
                            double dropout, bool train, bool bidirectional, bool batch_first,
                            bool grad, const std::function<GruOutputs()>& ours);

}  // namespace ddpx::detail
