#pragma once
// Who owns what under GradSyncOptions::shard (ZeRO-1/2): the parameters'
// bytes, concatenated in GradSync's parameter order (registration order),
// are cut into W contiguous ranges of ceil-free equal size, rank r owning
// bytes [r*T/W, (r+1)*T/W); an element belongs to the rank whose range holds
// its first byte. So a tensor may be split between ranks, a rank may own
// nothing of a small tensor, and the split depends only on the parameters
// and W -- never on the bucket plan, which re-plans change.
//
// A bucket lays its slots out in ascending parameter order when sharded
// (GradSync::Impl::replan): global byte offsets then grow along the bucket,
// so each rank's elements of the bucket are one contiguous part of it, the
// unit of its reduction (to the owner) and of its gather (from the owner).
#include <cstdint>
#include <vector>

#include "hooks/bucket_planner.h"

namespace ddpx::hooks {

struct ShardPart {
  int rank;        // the owner
  int64_t offset;  // in the bucket, elements
  int64_t numel;
};

class ShardMap {
 public:
  ShardMap() = default;  // inactive: nothing sharded
  ShardMap(const std::vector<ParamInfo>& info, int world, int rank);
  bool active() const { return world_ > 0; }
  int world() const { return world_; }
  int rank() const { return rank_; }
  // Elements [first, second) of parameter p that rank r owns (may be empty).
  std::pair<int64_t, int64_t> range(int p, int r) const;
  std::pair<int64_t, int64_t> mine(int p) const { return range(p, rank_); }
  // The owners' parts of a bucket holding `params` (any order), whose
  // slots start at offset_of[p]; laid out in ascending parameter order,
  // each owner's elements are contiguous. Owners of nothing are left out.
  std::vector<ShardPart> parts(const std::vector<int>& params,
                               const std::vector<int>& offset_of) const;
  // Bytes of the parameters this rank owns, and of all of them.
  int64_t owned_bytes() const;
  int64_t total_bytes() const { return total_; }

 private:
  int64_t boundary(int r) const;  // the first byte of rank r's range
  int world_ = 0, rank_ = 0;
  int64_t total_ = 0;
  std::vector<int64_t> start_;  // per parameter: its first byte
  std::vector<int64_t> elem_;   // per parameter: bytes per element
  std::vector<int64_t> numel_;
};

}  // namespace ddpx::hooks
