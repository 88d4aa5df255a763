#pragma once
// The seam between a bucket and the wire: averages a flat bucket in place
// across the ranks of a process group, through the codec named in
// GradSyncOptions::codec (the comm hook of DDP, in C++).
#include <ddpx/codec.h>
#include <ddpx/comm.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace ddpx::hooks {

// The shapes of the parameters packed in a bucket (or a run of it), in slot
// order: a codec that compresses per matrix (PowerSGD) needs them.
using Shapes = std::vector<std::vector<int64_t>>;

// flat: [numel] bucket, averaged in place; key: stable name of the bucket
// (error-feedback state is kept per key); shapes: what flat packs.
using ReduceFn = std::function<void(at::Tensor& flat, const std::string& key, const Shapes& shapes,
                                    c10d::ProcessGroup&)>;

// Totals since make_reduce_fn: bytes this rank put on the wire and their
// float32-equivalent (the codec's stats; counted here for "none"). Read at a
// step boundary, when no reduction is in flight, the difference of two reads
// is one step's traffic.
using WireStatsFn = std::function<comm::CodecStats()>;

// The error-feedback residuals by key (empty for "none"). take = true drops
// every key's codec state (residuals, PowerSGD's Q; Codec::take_residuals):
// a re-plan changes what a bucket key holds, and carries the residuals over
// per parameter. take = false returns copies and leaves the state as it is
// (Codec::residuals: a checkpoint's).
using TakeResidualsFn = std::function<std::map<std::string, at::Tensor>(bool take)>;

ReduceFn make_reduce_fn(const std::string& codec, WireStatsFn* stats = nullptr,
                        TakeResidualsFn* take_residuals = nullptr);

}  // namespace ddpx::hooks
