#pragma once
// C++ entries of the int8 codec's private ops (ops/int8_codec.cpp), through
// the dispatcher, so the codec and the kernel tests call the same thing.
#include <ATen/core/Tensor.h>
#include <c10/util/OptionalArrayRef.h>

#include <optional>

namespace ddpx::detail {

// input [numel] float32 -> [packed_bytes] uint8 (layout: kernels/common/int8_codec.h).
// parts: the numels of the tensors input holds end to end, each chunked from
// its own first element; absent: input is one tensor.
at::Tensor int8_pack(const at::Tensor& input, int64_t chunk,
                     c10::OptionalArrayRef<int64_t> parts = std::nullopt);
// The same message for input + residual; residual [numel] float32 becomes
// (input + residual) - decode(message): error feedback in the packing pass.
at::Tensor int8_pack_ef(const at::Tensor& input, at::Tensor& residual, int64_t chunk,
                        c10::OptionalArrayRef<int64_t> parts = std::nullopt);
// packed [R, packed_bytes] uint8 -> [numel] float32: alpha times the sum of
// the R decoded rows, summed in row order (alpha folded into each scale).
at::Tensor int8_unpack_sum(const at::Tensor& packed, int64_t numel, int64_t chunk,
                           double alpha = 1.0,
                           c10::OptionalArrayRef<int64_t> parts = std::nullopt);
// The same, written into out [numel] float32.
at::Tensor& int8_unpack_sum_out(const at::Tensor& packed, int64_t numel, int64_t chunk,
                                double alpha, at::Tensor& out,
                                c10::OptionalArrayRef<int64_t> parts = std::nullopt);

}  // namespace ddpx::detail
