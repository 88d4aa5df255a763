// Private ops of the int8 codec (plugin/comm/codec_int8.cpp), dispatched by
// device: kernels/cpu/int8_codec_kernel.cpp and kernels/cuda/int8_codec_kernel.cu.
// The message layout is in kernels/common/int8_codec.h.
//   _int8_pack(input [numel] float32, chunk, parts=None) -> [packed_bytes] uint8
//   _int8_pack_ef(input, residual!, chunk, parts=None): packs input + residual
//       and leaves what the message did not carry in residual
//   _int8_unpack_sum(packed [R, packed_bytes] uint8, numel, chunk, alpha,
//       parts=None) -> [numel] float32: alpha times the sum of the R decoded
//       messages
// parts: the numels of the consecutive tensors input packs end to end; each
// is chunked from its own first element (None: input is one tensor).
//   _int8_unpack_sum.out: the same into a caller's buffer (the codec decodes
//       piece by piece into its result)
#include "ops/int8_codec.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  m.def("_int8_pack(Tensor input, int chunk, int[]? parts=None) -> Tensor");
  m.def(
      "_int8_pack_ef(Tensor input, Tensor(a!) residual, int chunk, int[]? parts=None) -> Tensor");
  m.def(
      "_int8_unpack_sum(Tensor packed, int numel, int chunk, float alpha=1., int[]? parts=None) "
      "-> Tensor");
  m.def(
      "_int8_unpack_sum.out(Tensor packed, int numel, int chunk, float alpha=1., "
      "int[]? parts=None, *, Tensor(a!) out) -> Tensor(a!)");
}

namespace ddpx::detail {

namespace {
template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name, const char* overload = "") {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).typed<Sig>();
}
}  // namespace

using Parts = at::OptionalIntArrayRef;

at::Tensor int8_pack(const at::Tensor& input, int64_t chunk, Parts parts) {
  static auto h = op<at::Tensor(const at::Tensor&, int64_t, Parts)>("ddpx::_int8_pack");
  return h.call(input, chunk, parts);
}

at::Tensor int8_pack_ef(const at::Tensor& input, at::Tensor& residual, int64_t chunk,
                        Parts parts) {
  static auto h =
      op<at::Tensor(const at::Tensor&, at::Tensor&, int64_t, Parts)>("ddpx::_int8_pack_ef");
  return h.call(input, residual, chunk, parts);
}

at::Tensor int8_unpack_sum(const at::Tensor& packed, int64_t numel, int64_t chunk, double alpha,
                           Parts parts) {
  static auto h = op<at::Tensor(const at::Tensor&, int64_t, int64_t, double, Parts)>(
      "ddpx::_int8_unpack_sum");
  return h.call(packed, numel, chunk, alpha, parts);
}

at::Tensor& int8_unpack_sum_out(const at::Tensor& packed, int64_t numel, int64_t chunk,
                                double alpha, at::Tensor& out, Parts parts) {
  static auto h =
      op<at::Tensor&(const at::Tensor&, int64_t, int64_t, double, Parts, at::Tensor&)>(
          "ddpx::_int8_unpack_sum", "out");
  return h.call(packed, numel, chunk, alpha, parts, out);
}

}  // namespace ddpx::detail
