#include "plugin/ps/layout.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace ddpx::ps::detail {

Layout Layout::plan(const std::vector<int64_t>& numels, int servers) {
  TORCH_CHECK(servers >= 1, "ddpx ps: the number of servers must be at least 1, got ", servers);
  Layout l;
  for (int64_t n : numels) l.total += n;
  l.shards.resize(servers);
  l.shard_numel.resize(servers);
  // Server k owns [cut(k), cut(k + 1)): lengths differ by at most one element.
  auto cut = [&](int k) { return l.total * k / servers; };
  int64_t start = 0;  // flat index of the current parameter's first element
  for (size_t p = 0; p < numels.size(); ++p) {
    const int64_t end = start + numels[p];
    for (int k = 0; k < servers; ++k) {
      const int64_t lo = std::max(start, cut(k)), hi = std::min(end, cut(k + 1));
      if (hi > lo) l.shards[k].push_back(Segment{static_cast<int>(p), lo - start, hi - lo});
    }
    start = end;
  }
  for (int k = 0; k < servers; ++k) l.shard_numel[k] = cut(k + 1) - cut(k);
  return l;
}

}  // namespace ddpx::ps::detail
