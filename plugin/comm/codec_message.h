#pragma once
// One rank's message of a codec, with no collective: what a point-to-point
// user sends (the parameter server's pushes, plugin/ps). The encodings are
// the collective codecs' own (codec_util.h), so a byte on this wire means
// what it means in an all-reduce:
//   none   numel float32
//   fp16   numel float16             bf16   numel bfloat16
//   int8   packed_bytes(numel, chunk): codes, padding, a float32 scale per chunk
//   topk   [k int32 indices | k float32 values], k = topk_count(ratio, numel)
// powersgd has no one-message form (it needs two rounds) and is refused.
// Error feedback: the caller keeps one [numel] float32 residual per tensor
// (per destination) and passes it to every encode of that tensor.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace ddpx::comm {

// Codec identities as they travel in message headers (values are on the wire).
enum class WireCodec : int32_t { None = 0, Fp16 = 1, Bf16 = 2, Int8 = 3, TopK = 4 };

struct MessageCodec {
  WireCodec id = WireCodec::None;
  int64_t chunk = 0;   // int8: elements per scale
  double ratio = 0.0;  // topk: fraction of elements sent

  // Parses a codec spec (make_codec's grammar); an unknown spec or powersgd is
  // a c10::Error naming it and listing the codecs.
  static MessageCodec parse(const std::string& spec);
  // From the fields of a received header; a c10::Error if they are not a codec.
  static MessageCodec from_wire(int32_t id, int64_t chunk, double ratio);
  std::string spec() const;

  // The exact length in bytes of the message of a numel-element tensor.
  int64_t message_bytes(int64_t numel) const;
  // x: [numel] float32 contiguous. residual: undefined (no error feedback) or
  // [numel] float32, updated in place. Returns [message_bytes] uint8.
  at::Tensor encode(const at::Tensor& x, at::Tensor residual) const;
  // msg: [message_bytes(numel)] uint8 (checked: a wrong length or an index
  // out of range is a c10::Error). Returns [numel] float32.
  at::Tensor decode(const at::Tensor& msg, int64_t numel) const;
};

}  // namespace ddpx::comm
