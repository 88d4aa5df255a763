#pragma once
// C++ entries of the int8 codec's private ops (ops/int8_codec.cpp), through
// the dispatcher, so the codec and the kernel tests call the same thing.
#include <ATen/core/Tensor.h>

namespace ddpx::detail {

// input [numel] float32 -> [packed_bytes] uint8 (layout: kernels/common/int8_codec.h)
at::Tensor int8_pack(const at::Tensor& input, int64_t chunk);
// packed [R, packed_bytes] uint8 -> [numel] float32, the sum of the R decoded rows
at::Tensor int8_unpack_sum(const at::Tensor& packed, int64_t numel, int64_t chunk);

}  // namespace ddpx::detail
