#pragma once
// The sharded path's collectives (GradSyncOptions::shard; its protocol in
// grad_sync_shard.cpp) over any c10d backend: a bucket's exact reduction to
// the owners of its parts (a reduce-scatter with uneven parts, some possibly
// empty) and the gather of the owners' parts back to every rank. Bytes on
// the wire: together an all-reduce's worth. A codec's reduce-scatter is its
// own (Codec::reduce_scatter_mean_packed).
#include <ATen/core/Tensor.h>

#include <functional>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "hooks/shard_map.h"

namespace ddpx::hooks {

// Of each part, what the Gloo all-to-all reduction and the gather in pieces
// move per collective: a few MiB of buffers per rank at a time, whatever
// the bucket's size.
inline constexpr int64_t kPieceBytes = int64_t{2} << 20;

// Each part's sum over pg's ranks into its owner's slice of `flat` (the
// other slices are left as they were, partly overwritten). A collective:
// every rank passes the same parts.
void reduce_to_owners(const at::Tensor& flat, const std::vector<ShardPart>& parts,
                      c10d::ProcessGroup& pg);

// Each owner's slice of `flat` into every rank's `flat` (a broadcast per
// part, all in flight at once). A collective, as above.
void gather_from_owners(const at::Tensor& flat, const std::vector<ShardPart>& parts,
                        c10d::ProcessGroup& pg);

// The same gather without a bucket-sized buffer (Shard::Gradients, whose
// bucket is gone once reduced): each owner's part goes to the other ranks
// in pieces of at most kPieceBytes, two in flight, so the gather holds
// two pieces whatever the bucket's size. On the owner, `fill(offset,
// piece)` writes the bucket's elements [offset, offset + piece.numel())
// into `piece`; on every other rank `take(offset, piece)` reads them. A
// collective, as above. `held(bytes)` is told of the pieces' memory as it is
// made (bytes > 0) and freed (< 0).
using PieceFn = std::function<void(int64_t offset, const at::Tensor& piece)>;
void gather_from_owners_in_pieces(const std::vector<ShardPart>& parts,
                                  const at::TensorOptions& options, c10d::ProcessGroup& pg,
                                  const PieceFn& fill, const PieceFn& take,
                                  const std::function<void(int64_t bytes)>& held);

}  // namespace ddpx::hooks
