// CPU kernels of ddpx::_int8_pack / _int8_unpack_sum (layout and element math
// in kernels/common/int8_codec.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "kernels/common/int8_codec.h"

namespace ddpx {
namespace {

namespace ic = kernels::int8_codec;

// Chunks per parallel task: about 64 KiB of input.
constexpr int64_t kGrainElements = 1 << 14;

void check_args(const at::Tensor& t, at::ScalarType st, int64_t dim, const char* arg,
                int64_t chunk) {
  TORCH_CHECK(t.scalar_type() == st && t.dim() == dim && t.is_contiguous(), arg, " must be a ", dim,
              "-D contiguous ", st, " tensor, got ", t.dim(), "-D ", t.scalar_type(),
              t.is_contiguous() ? "" : " (non-contiguous)");
  TORCH_CHECK(chunk > 0, "chunk must be positive, got ", chunk);
}

at::Tensor int8_pack_cpu(const at::Tensor& input, int64_t chunk) {
  check_args(input, at::kFloat, 1, "input", chunk);
  const int64_t n = input.numel();
  const int64_t chunks = ic::num_chunks(n, chunk);
  auto out = at::empty({ic::packed_bytes(n, chunk)}, input.options().dtype(at::kByte));
  const float* x = input.data_ptr<float>();
  uint8_t* base = out.data_ptr<uint8_t>();
  auto* codes = reinterpret_cast<int8_t*>(base);
  auto* scales = reinterpret_cast<float*>(base + ic::scales_offset(n));
  for (int64_t i = n; i < ic::scales_offset(n); ++i) base[i] = 0;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / chunk);
  at::parallel_for(0, chunks, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = ic::chunk_begin(c, chunk), e = ic::chunk_end(c, chunk, n);
      float absmax = 0.0f;
      for (int64_t i = b; i < e; ++i) {
        const float a = std::fabs(x[i]);
        absmax = (a > absmax || a != a) ? a : absmax;  // keep a NaN once seen
        if (absmax != absmax) break;
      }
      const float s = ic::scale_of(absmax);
      scales[c] = s;
      for (int64_t i = b; i < e; ++i) codes[i] = ic::encode(x[i], s);
    }
  });
  return out;
}

at::Tensor int8_unpack_sum_cpu(const at::Tensor& packed, int64_t numel, int64_t chunk) {
  check_args(packed, at::kByte, 2, "packed", chunk);
  TORCH_CHECK(numel >= 0 && packed.size(1) == ic::packed_bytes(numel, chunk),
              "packed must have packed_bytes(numel=", numel, ", chunk=", chunk,
              ") = ", ic::packed_bytes(numel, chunk), " bytes per row, got ", packed.size(1));
  const int64_t rows = packed.size(0), len = packed.size(1);
  const int64_t chunks = ic::num_chunks(numel, chunk);
  auto out = at::zeros({numel}, packed.options().dtype(at::kFloat));
  float* y = out.data_ptr<float>();
  const uint8_t* base = packed.data_ptr<uint8_t>();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / chunk);
  at::parallel_for(0, chunks, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < rows; ++r) {  // row order: every rank sums alike
      const uint8_t* row = base + r * len;
      const auto* codes = reinterpret_cast<const int8_t*>(row);
      const auto* scales = reinterpret_cast<const float*>(row + ic::scales_offset(numel));
      for (int64_t c = c0; c < c1; ++c) {
        const float s = scales[c];
        const int64_t e = ic::chunk_end(c, chunk, numel);
        for (int64_t i = ic::chunk_begin(c, chunk); i < e; ++i) y[i] += ic::decode(codes[i], s);
      }
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(ddpx, CPU, m) {
  m.impl("_int8_pack", &int8_pack_cpu);
  m.impl("_int8_unpack_sum", &int8_unpack_sum_cpu);
}

}  // namespace
}  // namespace ddpx
