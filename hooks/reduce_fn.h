#pragma once
// The seam between a bucket and the wire: averages a flat bucket in place
// across the ranks of a process group, through the codec named in
// GradSyncOptions::codec (the comm hook of DDP, in C++).
#include <ddpx/comm.h>

#include <functional>
#include <string>

namespace ddpx::hooks {

// flat: [numel] bucket, averaged in place; key: stable name of the bucket
// (error-feedback state is kept per key).
using ReduceFn = std::function<void(at::Tensor& flat, const std::string& key, c10d::ProcessGroup&)>;

ReduceFn make_reduce_fn(const std::string& codec);

}  // namespace ddpx::hooks
