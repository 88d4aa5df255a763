// Private ops of the int8 codec (plugin/comm/codec_int8.cpp), dispatched by
// device: kernels/cpu/int8_codec_kernel.cpp and kernels/cuda/int8_codec_kernel.cu.
// The message layout is in kernels/common/int8_codec.h.
//   _int8_pack(input [numel] float32, chunk) -> [packed_bytes] uint8
//   _int8_unpack_sum(packed [R, packed_bytes] uint8, numel, chunk) -> [numel]
//       float32: the sum of the R decoded messages, in row order
#include "ops/int8_codec.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  m.def("_int8_pack(Tensor input, int chunk) -> Tensor");
  m.def("_int8_unpack_sum(Tensor packed, int numel, int chunk) -> Tensor");
}

namespace ddpx::detail {

at::Tensor int8_pack(const at::Tensor& input, int64_t chunk) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::_int8_pack", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t)>();
  return op.call(input, chunk);
}

at::Tensor int8_unpack_sum(const at::Tensor& packed, int64_t numel, int64_t chunk) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::_int8_unpack_sum", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>();
  return op.call(packed, numel, chunk);
}

}  // namespace ddpx::detail
