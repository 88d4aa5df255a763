#pragma once
// C++ entry points of the ddpx ops. Each calls through the dispatcher, so C++
// callers get the same autograd and device dispatch as torch.ops.ddpx.*.
#include <ATen/core/Tensor.h>

#include <string>

namespace ddpx {

// Version of the loaded plugin, "MAJOR.MINOR.PATCH".
std::string version();

// Whole-sequence GRU with torch.nn.GRU's semantics; params in nn.GRU's
// _flat_weights order (w_ih, w_hh[, b_ih, b_hh] per layer and direction).
// Returns (output, h_n).
std::tuple<at::Tensor, at::Tensor> fused_gru(const at::Tensor& input,
                                             const std::optional<at::Tensor>& hx,
                                             at::TensorList params, bool has_biases,
                                             int64_t num_layers, double dropout, bool train,
                                             bool bidirectional, bool batch_first);

}  // namespace ddpx
