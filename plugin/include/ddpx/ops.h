#pragma once
// C++ entry points of the ddpx ops. Each calls through the dispatcher, so C++
// callers get the same autograd and device dispatch as torch.ops.ddpx.*.
#include <ATen/core/Tensor.h>

#include <string>

namespace ddpx {

// Version of the loaded plugin, "MAJOR.MINOR.PATCH".
std::string version();

// Mean of `input` over the ranks of `group` through `codec` (grammar and
// protocol in ddpx/codec.h); `key` names the codec's persistent state.
at::Tensor compressed_allreduce(const at::Tensor& input, const std::string& codec = "none",
                                const std::string& key = "", const std::string& group = "");

}  // namespace ddpx
