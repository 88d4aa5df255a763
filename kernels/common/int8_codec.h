#pragma once
// The int8 codec's message layout and element math, shared by the CPU kernel,
// the CUDA kernel and the CPU tests.
//
// One rank's message, in bytes (packed_bytes(numel, chunks) of them):
//   [0, numel)                                int8 codes, one per element
//   [numel, scales_offset(numel))             zero padding to 4-byte alignment
//   [scales_offset, + 4 * chunks)             float32 scale per chunk: absmax / 127
// Chunks: `chunk` elements each from the first element, the last one shorter;
// or, given the numels of consecutive parts (the tensors of a packed bucket),
// the same rule within each part: every part's chunks start at its first
// element, so what a tensor's elements become does not depend on which
// tensors share its message or where it sits in it (ChunkMap).
// The message length is a multiple of 4, so in a gathered [world, L] buffer
// every row's scales are float-aligned.
// Element x of a chunk with scale s has code rint(x / s) clamped to
// [-127, 127]; it decodes to code * s, within s/2 = absmax/254 of x.
#include <cmath>
#include <cstdint>

#include "kernels/common/host_device.h"

namespace ddpx::kernels::int8_codec {

DDPX_HD int64_t num_chunks(int64_t numel, int64_t chunk) { return (numel + chunk - 1) / chunk; }

DDPX_HD int64_t scales_offset(int64_t numel) { return (numel + 3) / 4 * 4; }

DDPX_HD int64_t packed_bytes(int64_t numel, int64_t chunk) {
  return scales_offset(numel) + 4 * num_chunks(numel, chunk);
}

// The message length for `chunks` chunks over numel elements (any layout).
DDPX_HD int64_t packed_bytes_for_chunks(int64_t numel, int64_t chunks) {
  return scales_offset(numel) + 4 * chunks;
}

DDPX_HD int64_t chunk_begin(int64_t c, int64_t chunk) { return c * chunk; }

DDPX_HD int64_t chunk_end(int64_t c, int64_t chunk, int64_t numel) {
  return (c + 1) * chunk < numel ? (c + 1) * chunk : numel;
}

// Chunk c spans [begin(c), end(c)): uniform (bounds == nullptr), or read from
// `bounds` ([chunks + 1] element offsets: int8_codec_parts.h).
struct ChunkMap {
  const int64_t* bounds;
  int64_t chunk;
  int64_t numel;
  DDPX_HD int64_t begin(int64_t c) const { return bounds ? bounds[c] : chunk_begin(c, chunk); }
  DDPX_HD int64_t end(int64_t c) const {
    return bounds ? bounds[c + 1] : chunk_end(c, chunk, numel);
  }
};

DDPX_HD float scale_of(float absmax) { return absmax / 127.0f; }

// Round to nearest, ties to even, for |q| <= 2^22: adding 1.5 * 2^23 pushes
// the fraction out of the mantissa under the default rounding mode, so the
// sum minus the constant is rint(q). Unlike rintf it vectorizes on baseline
// x86-64 (no SSE4.1 round instruction there), and it is what the CUDA kernel
// computes too. Needs strict IEEE evaluation (no -ffast-math reassociation).
DDPX_HD float round_small(float q) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  return (q + magic) - magic;
}

// Written branch-free (selects only) so the CPU loop vectorizes. A zero or
// NaN scale (an all-zero chunk, or a NaN in it) yields code 0; a NaN scale
// decodes to NaN, so the chunk's NaN reaches the result instead of vanishing.
DDPX_HD int8_t encode(float x, float scale) {
  float q = scale > 0.0f ? x / scale : 0.0f;
  q = q == q ? q : 0.0f;
  q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
  return static_cast<int8_t>(static_cast<int>(round_small(q)));
}

DDPX_HD float decode(int8_t code, float scale) { return static_cast<float>(code) * scale; }

// Error feedback keeps a chunk's residual only while its scale is finite. An
// inf or NaN in the chunk decodes it to NaN (above), which is what the
// result must say; m - decode would then be NaN too, and a residual that
// stays NaN would make every later message of the chunk NaN. (A step that
// sees one is skipped anyway: GradScaler, ddpx/amp.h.) Written as a
// subtraction so it vectorizes: inf - inf and NaN - NaN are NaN, never 0.
DDPX_HD bool keeps_residual(float scale) { return scale - scale == 0.0f; }

}  // namespace ddpx::kernels::int8_codec
