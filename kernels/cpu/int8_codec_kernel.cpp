// CPU kernels of the int8 codec's private ops (schemas in ops/int8_codec.cpp;
// layout and element math in kernels/common/int8_codec.h). The inner loops
// are branch-free over a chunk so the compiler vectorizes them at -O3.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "kernels/common/int8_codec.h"
#include "kernels/common/int8_codec_parts.h"

namespace ddpx {
namespace {

namespace ic = kernels::int8_codec;

// Chunks per parallel task: about 64 KiB of input.
constexpr int64_t kGrainElements = 1 << 14;

void check_args(const at::Tensor& t, at::ScalarType st, int64_t dim, const char* arg,
                int64_t chunk) {
  TORCH_CHECK(t.scalar_type() == st && t.dim() == dim && t.is_contiguous() && t.is_cpu(), arg,
              " must be a ", dim, "-D contiguous CPU ", st, " tensor, got ", t.dim(), "-D ",
              t.scalar_type(), " on ", t.device(), t.is_contiguous() ? "" : " (non-contiguous)");
  TORCH_CHECK(chunk > 0, "chunk must be positive, got ", chunk);
}

// |v| of the chunk's largest element, or NaN if it holds one. The maximum is
// taken over the bit patterns of |v|: for non-negative floats they order like
// the values, and every NaN pattern lies above +inf, so a plain unsigned max
// (which vectorizes, unlike a NaN-aware float max) propagates NaN.
float absmax(const float* v, int64_t len) {
  uint32_t m = 0;
  for (int64_t i = 0; i < len; ++i) {
    uint32_t b;
    std::memcpy(&b, v + i, sizeof b);
    b &= 0x7fffffffu;
    m = b > m ? b : m;
  }
  float a;
  std::memcpy(&a, &m, sizeof a);
  return a;
}

// Packs x (+ residual) into `out`, chunked by `bounds` (empty: uniform).
// With a residual e, e becomes m = x + e first and then m - decode(code):
// what this message did not carry.
at::Tensor pack(const at::Tensor& input, float* residual, int64_t chunk,
                at::OptionalIntArrayRef parts) {
  const int64_t n = input.numel();
  const std::vector<int64_t> bounds = ic::chunk_bounds(parts, n, chunk);
  const int64_t chunks = ic::chunk_count(bounds, n, chunk);
  const ic::ChunkMap map{bounds.empty() ? nullptr : bounds.data(), chunk, n};
  auto out = at::empty({ic::packed_bytes_for_chunks(n, chunks)}, input.options().dtype(at::kByte));
  const float* x = input.data_ptr<float>();
  uint8_t* base = out.data_ptr<uint8_t>();
  auto* codes = reinterpret_cast<int8_t*>(base);
  auto* scales = reinterpret_cast<float*>(base + ic::scales_offset(n));
  for (int64_t i = n; i < ic::scales_offset(n); ++i) base[i] = 0;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / chunk);
  at::parallel_for(0, chunks, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = map.begin(c), len = map.end(c) - b;
      const float* m = x + b;
      float* e = residual ? residual + b : nullptr;
      if (e) {
        for (int64_t i = 0; i < len; ++i) e[i] += m[i];
        m = e;
      }
      const float s = ic::scale_of(absmax(m, len));
      scales[c] = s;
      int8_t* q = codes + b;
      for (int64_t i = 0; i < len; ++i) q[i] = ic::encode(m[i], s);
      if (e && ic::keeps_residual(s)) {
        for (int64_t i = 0; i < len; ++i) e[i] -= ic::decode(q[i], s);
      } else if (e) {
        for (int64_t i = 0; i < len; ++i) e[i] = 0.0f;
      }
    }
  });
  return out;
}

at::Tensor int8_pack_cpu(const at::Tensor& input, int64_t chunk, at::OptionalIntArrayRef parts) {
  check_args(input, at::kFloat, 1, "input", chunk);
  return pack(input, nullptr, chunk, parts);
}

at::Tensor int8_pack_ef_cpu(const at::Tensor& input, at::Tensor& residual, int64_t chunk,
                            at::OptionalIntArrayRef parts) {
  check_args(input, at::kFloat, 1, "input", chunk);
  check_args(residual, at::kFloat, 1, "residual", chunk);
  TORCH_CHECK(residual.numel() == input.numel(), "residual must have input's ", input.numel(),
              " elements, got ", residual.numel());
  return pack(input, residual.data_ptr<float>(), chunk, parts);
}

at::Tensor& int8_unpack_sum_out_cpu(const at::Tensor& packed, int64_t numel, int64_t chunk,
                                    double alpha, at::OptionalIntArrayRef parts,
                                    at::Tensor& out) {
  check_args(packed, at::kByte, 2, "packed", chunk);
  int64_t chunks = 0;
  const std::vector<int64_t> bounds =
      ic::unpack_bounds(packed.size(1), numel, chunk, parts, &chunks);
  TORCH_CHECK(packed.size(0) >= 1, "packed must hold at least one row");
  check_args(out, at::kFloat, 1, "out", chunk);
  TORCH_CHECK(out.numel() == numel, "out must have numel = ", numel, " elements, got ",
              out.numel());
  const ic::ChunkMap map{bounds.empty() ? nullptr : bounds.data(), chunk, numel};
  const int64_t rows = packed.size(0), len = packed.size(1);
  const auto a = static_cast<float>(alpha);
  float* y = out.data_ptr<float>();
  const uint8_t* base = packed.data_ptr<uint8_t>();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / chunk);
  at::parallel_for(0, chunks, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < rows; ++r) {  // row order: every rank sums alike
      const uint8_t* row = base + r * len;
      const auto* codes = reinterpret_cast<const int8_t*>(row);
      const auto* scales = reinterpret_cast<const float*>(row + ic::scales_offset(numel));
      for (int64_t c = c0; c < c1; ++c) {
        const float s = scales[c] * a;
        const int64_t b = map.begin(c), e = map.end(c);
        if (r == 0) {
          for (int64_t i = b; i < e; ++i) y[i] = ic::decode(codes[i], s);
        } else {
          for (int64_t i = b; i < e; ++i) y[i] += ic::decode(codes[i], s);
        }
      }
    }
  });
  return out;
}

at::Tensor int8_unpack_sum_cpu(const at::Tensor& packed, int64_t numel, int64_t chunk,
                               double alpha, at::OptionalIntArrayRef parts) {
  auto out = at::empty({std::max<int64_t>(numel, 0)}, packed.options().dtype(at::kFloat));
  return int8_unpack_sum_out_cpu(packed, numel, chunk, alpha, parts, out);
}

TORCH_LIBRARY_IMPL(ddpx, CPU, m) {
  m.impl("_int8_pack", &int8_pack_cpu);
  m.impl("_int8_pack_ef", &int8_pack_ef_cpu);
  m.impl("_int8_unpack_sum", &int8_unpack_sum_cpu);
  m.impl("_int8_unpack_sum.out", &int8_unpack_sum_out_cpu);
}

}  // namespace
}  // namespace ddpx
