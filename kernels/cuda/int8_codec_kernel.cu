// CUDA kernels of ddpx::_int8_pack / _int8_unpack_sum: thin launch shells
// over kernels/common/int8_codec.h, the same math the CPU kernel runs.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/common/int8_codec.h"

namespace ddpx {
namespace {

namespace ic = kernels::int8_codec;

constexpr int kThreads = 256;

struct PackParams {
  const float* x;  // [numel]
  float* e;        // [numel] residual, or nullptr
  uint8_t* out;    // [packed_bytes(numel, chunk)]
  int64_t numel;
  int64_t chunk;
};

// One block per chunk: block-wide absmax, then every thread encodes. With a
// residual, e = x + e first and e -= decode(code) last; a thread touches the
// same elements in every loop, so no barrier is needed between them.
__global__ void pack_kernel(PackParams p) {
  __shared__ float red[kThreads];
  const int64_t c = blockIdx.x;
  const int64_t b = ic::chunk_begin(c, p.chunk), e = ic::chunk_end(c, p.chunk, p.numel);
  const float* m = p.x;
  if (p.e) {
    for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x) p.e[i] += p.x[i];
    m = p.e;
  }
  float absmax = 0.0f;
  for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x) {
    const float a = fabsf(m[i]);
    absmax = (a > absmax || a != a) ? a : absmax;
  }
  red[threadIdx.x] = absmax;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const float o = red[threadIdx.x + s];
      const float m = red[threadIdx.x];
      red[threadIdx.x] = (o > m || o != o) ? o : m;
    }
    __syncthreads();
  }
  const float scale = ic::scale_of(red[0]);
  auto* codes = reinterpret_cast<int8_t*>(p.out);
  for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x) {
    codes[i] = ic::encode(m[i], scale);
    // __fsub_rn / __fadd_rn: never contracted into an FMA, so the result is
    // the CPU kernel's bit for bit (tests/python/test_int8_codec_cuda.py).
    if (p.e) p.e[i] = __fsub_rn(p.e[i], ic::decode(codes[i], scale));
  }
  if (threadIdx.x == 0) {
    reinterpret_cast<float*>(p.out + ic::scales_offset(p.numel))[c] = scale;
    if (c == 0) {
      for (int64_t i = p.numel; i < ic::scales_offset(p.numel); ++i) p.out[i] = 0;
    }
  }
}

struct UnpackParams {
  const uint8_t* packed;  // [rows, len]
  float* y;               // [numel]
  int64_t rows;
  int64_t len;
  int64_t numel;
  int64_t chunk;
  float alpha;
};

// Grid-stride over elements; rows summed in order, as on the CPU.
__global__ void unpack_sum_kernel(UnpackParams p) {
  const int64_t off = ic::scales_offset(p.numel);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i / p.chunk;
    float acc = 0.0f;
    for (int64_t r = 0; r < p.rows; ++r) {
      const uint8_t* row = p.packed + r * p.len;
      const float s = __fmul_rn(reinterpret_cast<const float*>(row + off)[c], p.alpha);
      acc = __fadd_rn(acc, ic::decode(reinterpret_cast<const int8_t*>(row)[i], s));
    }
    p.y[i] = acc;
  }
}

void check_args(const at::Tensor& t, at::ScalarType st, int64_t dim, const char* arg,
                int64_t chunk) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == st && t.dim() == dim && t.is_contiguous(), arg,
              " must be a ", dim, "-D contiguous CUDA ", st, " tensor, got ", t.dim(), "-D ",
              t.scalar_type(), " on ", t.device());
  TORCH_CHECK(chunk > 0, "chunk must be positive, got ", chunk);
}

void pack(const at::Tensor& input, float* residual, int64_t chunk, at::Tensor& out) {
  const int64_t n = input.numel();
  const int64_t chunks = ic::num_chunks(n, chunk);
  if (chunks == 0) return;
  TORCH_CHECK(chunks <= INT32_MAX, "input has too many chunks (", chunks, ") for one launch");
  PackParams p{input.data_ptr<float>(), residual, out.data_ptr<uint8_t>(), n, chunk};
  pack_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor int8_pack_cuda(const at::Tensor& input, int64_t chunk) {
  check_args(input, at::kFloat, 1, "input", chunk);
  c10::cuda::CUDAGuard guard(input.device());
  auto out = at::empty({ic::packed_bytes(input.numel(), chunk)}, input.options().dtype(at::kByte));
  pack(input, nullptr, chunk, out);
  return out;
}

at::Tensor int8_pack_ef_cuda(const at::Tensor& input, at::Tensor& residual, int64_t chunk) {
  check_args(input, at::kFloat, 1, "input", chunk);
  check_args(residual, at::kFloat, 1, "residual", chunk);
  TORCH_CHECK(residual.numel() == input.numel() && residual.device() == input.device(),
              "residual must have input's ", input.numel(), " elements on ", input.device(),
              ", got ", residual.numel(), " on ", residual.device());
  c10::cuda::CUDAGuard guard(input.device());
  auto out = at::empty({ic::packed_bytes(input.numel(), chunk)}, input.options().dtype(at::kByte));
  pack(input, residual.data_ptr<float>(), chunk, out);
  return out;
}

at::Tensor& int8_unpack_sum_out_cuda(const at::Tensor& packed, int64_t numel, int64_t chunk,
                                     double alpha, at::Tensor& out) {
  check_args(packed, at::kByte, 2, "packed", chunk);
  TORCH_CHECK(numel >= 0 && packed.size(1) == ic::packed_bytes(numel, chunk),
              "packed must have packed_bytes(numel=", numel, ", chunk=", chunk,
              ") = ", ic::packed_bytes(numel, chunk), " bytes per row, got ", packed.size(1));
  check_args(out, at::kFloat, 1, "out", chunk);
  TORCH_CHECK(out.numel() == numel && out.device() == packed.device(), "out must have numel = ",
              numel, " elements on ", packed.device(), ", got ", out.numel(), " on ",
              out.device());
  c10::cuda::CUDAGuard guard(packed.device());
  if (numel == 0) return out;
  UnpackParams p{packed.data_ptr<uint8_t>(),
                 out.data_ptr<float>(),
                 packed.size(0),
                 packed.size(1),
                 numel,
                 chunk,
                 static_cast<float>(alpha)};
  const int64_t blocks = std::min<int64_t>((numel + kThreads - 1) / kThreads, 65535 * 8);
  unpack_sum_kernel<<<static_cast<unsigned>(blocks), kThreads, 0,
                      at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor int8_unpack_sum_cuda(const at::Tensor& packed, int64_t numel, int64_t chunk,
                                double alpha) {
  auto out = at::empty({std::max<int64_t>(numel, 0)}, packed.options().dtype(at::kFloat));
  return int8_unpack_sum_out_cuda(packed, numel, chunk, alpha, out);
}

TORCH_LIBRARY_IMPL(ddpx, CUDA, m) {
  m.impl("_int8_pack", &int8_pack_cuda);
  m.impl("_int8_pack_ef", &int8_pack_ef_cuda);
  m.impl("_int8_unpack_sum", &int8_unpack_sum_cuda);
  m.impl("_int8_unpack_sum.out", &int8_unpack_sum_out_cuda);
}

}  // namespace
}  // namespace ddpx
