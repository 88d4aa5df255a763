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

// torch.nn.functional.conv2d semantics (3-D unbatched or 4-D input, groups,
// channels-last) by ddpx's tiled kernels; differentiable.
// input [N, C_in, H, W] or [C_in, H, W]; weight [C_out, C_in/groups, kH, kW];
// bias [C_out]; returns [N, C_out, H_out, W_out] (or [C_out, H_out, W_out]).
at::Tensor tiled_conv2d(const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias = std::nullopt,
                        at::IntArrayRef stride = {1, 1}, at::IntArrayRef padding = {0, 0},
                        at::IntArrayRef dilation = {1, 1}, int64_t groups = 1);

// Which algorithm tiled_conv2d takes for these arguments on input's device:
// on CPU "direct", "gemm" or "aten", "<forward>/<backward>" when they differ.
std::string tiled_conv2d_path(const at::Tensor& input, const at::Tensor& weight,
                              at::IntArrayRef stride = {1, 1}, at::IntArrayRef padding = {0, 0},
                              at::IntArrayRef dilation = {1, 1}, int64_t groups = 1);

// How fused_gru runs for `input` on its device: on CPU its gate step,
// "serial" or "batch-parallel:<tasks>"; on CUDA "cudnn", "aten" (at::gru
// without cuDNN), "persistent", "step" or "benchmark" (README).
std::string fused_gru_path(const at::Tensor& input, int64_t hidden_size, bool batch_first = false);

// Mean of `input` over the ranks of `group` through `codec` (grammar and
// protocol in ddpx/codec.h); `key` names the codec's persistent state.
at::Tensor compressed_allreduce(const at::Tensor& input, const std::string& codec = "none",
                                const std::string& key = "", const std::string& group = "");

}  // namespace ddpx
