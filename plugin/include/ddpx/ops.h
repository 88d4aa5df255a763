#pragma once
// C++ entry points of the ddpx ops. Each calls through the dispatcher, so C++
// callers get the same autograd and device dispatch as torch.ops.ddpx.*.
#include <ATen/core/Tensor.h>

#include <string>

namespace ddpx {

// Version of the loaded plugin, "MAJOR.MINOR.PATCH".
std::string version();

// torch.nn.functional.conv2d semantics (3-D unbatched or 4-D input, groups,
// channels-last) by ddpx's tiled kernels; differentiable.
// input [N, C_in, H, W] or [C_in, H, W]; weight [C_out, C_in/groups, kH, kW];
// bias [C_out]; returns [N, C_out, H_out, W_out] (or [C_out, H_out, W_out]).
at::Tensor tiled_conv2d(const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias = std::nullopt,
                        at::IntArrayRef stride = {1, 1}, at::IntArrayRef padding = {0, 0},
                        at::IntArrayRef dilation = {1, 1}, int64_t groups = 1);

}  // namespace ddpx
