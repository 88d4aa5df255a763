#pragma once
// The int8 codec's message layout and element math, shared by the CPU kernel,
// the CUDA kernel and the CPU tests.
//
// One rank's message, in bytes (packed_bytes(numel, chunk) of them):
//   [0, numel)                                int8 codes, one per element
//   [numel, scales_offset(numel))             zero padding to 4-byte alignment
//   [scales_offset, + 4 * num_chunks)         float32 scale per chunk of `chunk`
//                                             elements: absmax / 127
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

DDPX_HD int64_t chunk_begin(int64_t c, int64_t chunk) { return c * chunk; }

DDPX_HD int64_t chunk_end(int64_t c, int64_t chunk, int64_t numel) {
  return (c + 1) * chunk < numel ? (c + 1) * chunk : numel;
}

DDPX_HD float scale_of(float absmax) { return absmax / 127.0f; }

// A NaN scale (a NaN in the chunk) yields code 0, which decodes to NaN: the
// chunk's NaN reaches the result instead of vanishing.
DDPX_HD int8_t encode(float x, float scale) {
  if (!(scale > 0.0f)) return 0;
  float q = x / scale;
  if (q != q) return 0;
  q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
  return static_cast<int8_t>(rintf(q));
}

DDPX_HD float decode(int8_t code, float scale) { return static_cast<float>(code) * scale; }

}  // namespace ddpx::kernels::int8_codec
