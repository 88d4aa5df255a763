#pragma once
// The encodings of the lossy codecs without their collectives, shared by the
// collective codecs (codec_half.cpp, codec_topk.cpp) and their point-to-point
// form (codec_message.h).
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ddpx::comm::detail {

// fp16/bf16: ((x + e) / world) in `wire`; e (when defined, [numel] float32)
// becomes (x + e) - q * world in place.
at::Tensor half_pack_ef(const at::Tensor& x, const at::Tensor& e, at::ScalarType wire,
                        int64_t world);
// top-k: k = ceil(ratio * n) clamped to [1, n]; the message of m ([n] float32)
// is [k int32 indices | k float32 values viewed as int32]; *idx gets the
// indices (int64). largest_k(a, k): indices of the k largest of a (>= 0).
int64_t topk_count(double ratio, int64_t n);
at::Tensor largest_k(const at::Tensor& a, int64_t k);
at::Tensor topk_pack(const at::Tensor& m, int64_t k, at::Tensor* idx);
// rows [R, 2k] int32 messages -> [n] float32, their sum.
at::Tensor topk_unpack_sum(const at::Tensor& rows, int64_t n, int64_t k);

}  // namespace ddpx::comm::detail
