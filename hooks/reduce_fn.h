#pragma once
// The seam between a bucket and the wire: averages a flat bucket in place
// across the ranks of a process group, through the codec named in
// GradSyncOptions::codec (the comm hook of DDP, in C++).
#include <ddpx/codec.h>
#include <ddpx/comm.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ddpx::hooks {

// The shapes of the parameters packed in a bucket (or a run of it), in slot
// order: a codec that compresses per matrix (PowerSGD) needs them.
using Shapes = std::vector<std::vector<int64_t>>;

// flat: [numel] bucket, averaged in place; key: stable name of the bucket
// (error-feedback state is kept per key); shapes: what flat packs;
// part_keys: a name per packed tensor that outlives the bucket (GradSync:
// one per parameter), under which a codec keeps a tensor's own state
// (PowerSGD's warm start).
using ReduceFn = std::function<void(at::Tensor& flat, const std::string& key, const Shapes& shapes,
                                    const std::vector<std::string>& part_keys,
                                    c10d::ProcessGroup&)>;

// Totals since make_reduce_fn: bytes this rank put on the wire and their
// float32-equivalent (the codec's stats; counted here for "none"). Read at a
// step boundary, when no reduction is in flight, the difference of two reads
// is one step's traffic.
using WireStatsFn = std::function<comm::CodecStats()>;

// *lossy: the codec behind the ReduceFn, whose per-key state (error-feedback
// residuals by bucket key, warm starts by part key) its owner reads and moves
// (Codec::take_residuals at a re-plan, residuals() and warm_starts() for a
// checkpoint); null for "none", which keeps no state.
// stage_chunk_bytes (> 0): "none" stages a device bucket through pinned host
// memory in chunks of that many bytes (plugin/comm/host_stage.h) when the group's
// backend for the device reduces host memory only (comm::detail::
// stages_through_host); 0 hands the backend the device bucket. Codecs hand
// the backend their (small) messages as they are.
ReduceFn make_reduce_fn(const std::string& codec, WireStatsFn* stats = nullptr,
                        std::shared_ptr<comm::Codec>* lossy = nullptr,
                        int64_t stage_chunk_bytes = 0);

}  // namespace ddpx::hooks
