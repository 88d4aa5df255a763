#pragma once
// Host side of the int8 codec's per-part chunks (ChunkMap in int8_codec.h):
// the ops' optional `parts` argument checked and turned into chunk bounds.
// Shared by the CPU and CUDA kernels so both refuse the same input alike.
#include <c10/util/Exception.h>
#include <c10/util/OptionalArrayRef.h>

#include <cstdint>
#include <vector>

#include "kernels/common/int8_codec.h"

namespace ddpx::kernels::int8_codec {

// [chunks + 1] element offsets of the chunks of `parts` (numels of
// consecutive parts, each >= 0, summing to numel), each part chunked from its
// own first element. Empty when parts is absent: uniform chunks (no table).
inline std::vector<int64_t> chunk_bounds(c10::OptionalArrayRef<int64_t> parts, int64_t numel,
                                         int64_t chunk) {
  std::vector<int64_t> bounds;
  if (!parts.has_value()) return bounds;
  bounds.push_back(0);
  int64_t off = 0;
  for (int64_t m : *parts) {
    TORCH_CHECK(m >= 0, "parts must hold numels >= 0, got ", m);
    for (int64_t c = 0; c < num_chunks(m, chunk); ++c) bounds.push_back(off + chunk_end(c, chunk, m));
    off += m;
  }
  TORCH_CHECK(off == numel, "parts must sum to the ", numel, " elements, got ", off, " (",
              parts->size(), " parts)");
  return bounds;
}

// Chunks of a message over numel elements with these bounds (or uniform).
inline int64_t chunk_count(const std::vector<int64_t>& bounds, int64_t numel, int64_t chunk) {
  return bounds.empty() ? num_chunks(numel, chunk) : static_cast<int64_t>(bounds.size()) - 1;
}

// An unpack's checks: numel >= 0 and rows of the length its chunks give.
// Returns the bounds (as chunk_bounds) and sets *chunks.
inline std::vector<int64_t> unpack_bounds(int64_t row_bytes, int64_t numel, int64_t chunk,
                                          c10::OptionalArrayRef<int64_t> parts, int64_t* chunks) {
  TORCH_CHECK(numel >= 0, "numel must be >= 0, got ", numel);
  std::vector<int64_t> bounds = chunk_bounds(parts, numel, chunk);
  *chunks = chunk_count(bounds, numel, chunk);
  const int64_t want = packed_bytes_for_chunks(numel, *chunks);
  TORCH_CHECK(row_bytes == want, "packed must have ", want, " bytes per row (numel=", numel,
              ", chunk=", chunk, ", ", *chunks, " chunks), got ", row_bytes);
  return bounds;
}

}  // namespace ddpx::kernels::int8_codec
