// GradSync's ZeRO ownership (hooks/shard_map.h).
#include "hooks/shard_map.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace ddpx::hooks {

ShardMap::ShardMap(const std::vector<ParamInfo>& info, int world, int rank)
    : world_(world), rank_(rank) {
  TORCH_CHECK(world > 0 && rank >= 0 && rank < world, "ShardMap: rank ", rank, " of ", world);
  for (const auto& i : info) {
    start_.push_back(total_);
    elem_.push_back(static_cast<int64_t>(c10::elementSize(i.dtype)));
    numel_.push_back(i.numel);
    total_ += i.numel * elem_.back();
  }
}

int64_t ShardMap::boundary(int r) const {
  // (128-bit-free: total_ * r stays far below 2^63 for any real model.)
  return total_ * r / world_;
}

std::pair<int64_t, int64_t> ShardMap::range(int p, int r) const {
  // Element i belongs to r when boundary(r) <= start + i*e < boundary(r+1):
  // i in [ceil((boundary(r) - start) / e), ceil((boundary(r+1) - start) / e)).
  const int64_t s = start_[p], e = elem_[p], n = numel_[p];
  auto first_at_or_after = [&](int64_t byte) {
    const int64_t rel = byte - s;
    if (rel <= 0) return int64_t{0};
    return std::min(n, (rel + e - 1) / e);
  };
  const int64_t lo = first_at_or_after(boundary(r));
  const int64_t hi = r + 1 == world_ ? n : first_at_or_after(boundary(r + 1));
  return {lo, std::max(lo, hi)};
}

std::vector<ShardPart> ShardMap::parts(const std::vector<int>& params,
                                       const std::vector<int>& offset_of) const {
  std::vector<int> sorted = params;
  std::sort(sorted.begin(), sorted.end());
  std::vector<ShardPart> out;
  for (int r = 0; r < world_; ++r) {
    int64_t lo = -1, hi = -1;
    for (int p : sorted) {
      const auto [a, b] = range(p, r);
      if (a == b) continue;
      const int64_t from = offset_of[p] + a, to = offset_of[p] + b;
      TORCH_CHECK(hi < 0 || from == hi, "ShardMap: rank ", r,
                  "'s part of a bucket is not "
                  "contiguous (parameter ",
                  p, " at ", from, ", the part ends at ", hi,
                  "): its slots must be laid out in ascending parameter order");
      if (lo < 0) lo = from;
      hi = to;
    }
    if (lo >= 0) out.push_back({r, lo, hi - lo});
  }
  return out;
}

int64_t ShardMap::owned_bytes() const {
  int64_t bytes = 0;
  for (size_t p = 0; p < start_.size(); ++p) {
    const auto [a, b] = mine(static_cast<int>(p));
    bytes += (b - a) * elem_[p];
  }
  return bytes;
}

}  // namespace ddpx::hooks
