// Private ops of the int8 codec (plugin/comm/codec_int8.cpp), dispatched by
// device: kernels/cpu/int8_codec_kernel.cpp and kernels/cuda/int8_codec_kernel.cu.
// The message layout is in kernels/common/int8_codec.h.
//   _int8_pack(input [numel] float32, chunk) -> [packed_bytes] uint8
//   _int8_pack_ef(input, residual!, chunk): packs input + residual and leaves
//       what the message did not carry in residual
//   _int8_unpack_sum(packed [R, packed_bytes] uint8, numel, chunk, alpha)
//       -> [numel] float32: alpha times the sum of the R decoded messages
//   _int8_unpack_sum.out: the same into a caller's buffer (the codec decodes
//       piece by piece into its result)
#include "ops/int8_codec.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  m.def("_int8_pack(Tensor input, int chunk) -> Tensor");
  m.def("_int8_pack_ef(Tensor input, Tensor(a!) residual, int chunk) -> Tensor");
  m.def("_int8_unpack_sum(Tensor packed, int numel, int chunk, float alpha=1.) -> Tensor");
  m.def(
      "_int8_unpack_sum.out(Tensor packed, int numel, int chunk, float alpha=1., *, "
      "Tensor(a!) out) -> Tensor(a!)");
}

namespace ddpx::detail {

namespace {
template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name, const char* overload = "") {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).typed<Sig>();
}
}  // namespace

at::Tensor int8_pack(const at::Tensor& input, int64_t chunk) {
  static auto h = op<at::Tensor(const at::Tensor&, int64_t)>("ddpx::_int8_pack");
  return h.call(input, chunk);
}

at::Tensor int8_pack_ef(const at::Tensor& input, at::Tensor& residual, int64_t chunk) {
  static auto h = op<at::Tensor(const at::Tensor&, at::Tensor&, int64_t)>("ddpx::_int8_pack_ef");
  return h.call(input, residual, chunk);
}

at::Tensor int8_unpack_sum(const at::Tensor& packed, int64_t numel, int64_t chunk, double alpha) {
  static auto h =
      op<at::Tensor(const at::Tensor&, int64_t, int64_t, double)>("ddpx::_int8_unpack_sum");
  return h.call(packed, numel, chunk, alpha);
}

at::Tensor& int8_unpack_sum_out(const at::Tensor& packed, int64_t numel, int64_t chunk,
                                double alpha, at::Tensor& out) {
  static auto h = op<at::Tensor&(const at::Tensor&, int64_t, int64_t, double, at::Tensor&)>(
      "ddpx::_int8_unpack_sum", "out");
  return h.call(packed, numel, chunk, alpha, out);
}

}  // namespace ddpx::detail
