#pragma once
// C++ entry points of the ddpx ops. Each calls through the dispatcher, so C++
// callers get the same autograd and device dispatch as torch.ops.ddpx.*.
#include <ATen/core/Tensor.h>

#include <string>

namespace ddpx {

// Version of the loaded plugin, "MAJOR.MINOR.PATCH".
std::string version();

}  // namespace ddpx
