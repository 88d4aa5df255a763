#pragma once
// Internal ops of ddpx::fused_gru (not public API): the forward that also
// returns what backward needs, and the backward. Both go through the
// dispatcher, so the autograd kernel reaches the CPU, CUDA or Meta kernel.
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

namespace ddpx::detail {

// (output, h_n, gates, layer_outputs, dropout_masks); the last three are the
// saved tensors described in kernels/common/gru_sequence.h.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> _fused_gru_forward(
    const at::Tensor& input, const std::optional<at::Tensor>& hx, at::TensorList params,
    bool has_biases, int64_t num_layers, double dropout, bool train, bool bidirectional,
    bool batch_first);

// (grad_input, grad_hx, grad_params); grad_hx is dL/d(initial state) also when
// hx was None (the zeros used then).
std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> _fused_gru_backward(
    const at::Tensor& grad_output, const at::Tensor& grad_hy, const at::Tensor& input,
    const std::optional<at::Tensor>& hx, at::TensorList params, const at::Tensor& output,
    const at::Tensor& gates, const at::Tensor& layer_outputs, const at::Tensor& dropout_masks,
    bool has_biases, int64_t num_layers, bool bidirectional, bool batch_first);

}  // namespace ddpx::detail
