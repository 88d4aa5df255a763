// Private ops of the int8 codec (plugin/comm/codec_int8.cpp), dispatched by
// device: kernels/cpu/int8_codec_kernel.cpp and kernels/cuda/int8_codec_kernel.cu.
// The message layout is in kernels/common/int8_codec.h.
//   _int8_pack(input [numel] float32, chunk) -> [packed_bytes] uint8
//   _int8_unpack_sum(packed [R, packed_bytes] uint8, numel, chunk) -> [numel]
//       float32: the sum of the R decoded messages, in row order
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  m.def("_int8_pack(Tensor input, int chunk) -> Tensor");
  m.def("_int8_unpack_sum(Tensor packed, int numel, int chunk) -> Tensor");
}
