#pragma once
// Which server holds which elements (step "Roles" of the protocol in
// ddpx/ps.h): the parameters end to end as one flat vector, cut into K runs of
// (almost) equal length, so every server holds the same number of bytes and a
// tensor that crosses a cut is split.
#include <cstdint>
#include <vector>

namespace ddpx::ps::detail {

// Elements [offset, offset + numel) of parameter `param`, flattened.
struct Segment {
  int param = 0;
  int64_t offset = 0;
  int64_t numel = 0;
};

struct Layout {
  int64_t total = 0;
  std::vector<std::vector<Segment>> shards;  // [server] -> its segments, in parameter order
  std::vector<int64_t> shard_numel;          // [server]

  // numels: each parameter's element count, in order.
  static Layout plan(const std::vector<int64_t>& numels, int servers);
};

}  // namespace ddpx::ps::detail
