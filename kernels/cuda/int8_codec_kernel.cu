// CUDA kernels of ddpx::_int8_pack / _int8_unpack_sum: thin launch shells
// over kernels/common/int8_codec.h, the same math the CPU kernel runs.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "kernels/common/int8_codec.h"
#include "kernels/common/int8_codec_parts.h"

namespace ddpx {
namespace {

namespace ic = kernels::int8_codec;

constexpr int kThreads = 256;

struct PackParams {
  const float* x;    // [numel]
  float* e;          // [numel] residual, or nullptr
  uint8_t* out;      // [packed_bytes_for_chunks(numel, chunks)]
  ic::ChunkMap map;  // bounds: device memory, or nullptr (uniform chunks)
};

// One block per chunk: block-wide absmax, then every thread encodes. With a
// residual, e = x + e first and e -= decode(code) last; a thread touches the
// same elements in every loop, so no barrier is needed between them.
__global__ void pack_kernel(PackParams p) {
  __shared__ float red[kThreads];
  const int64_t c = blockIdx.x;
  const int64_t b = p.map.begin(c), e = p.map.end(c);
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
  const bool keep = ic::keeps_residual(scale);  // (an inf or NaN in the chunk: none kept)
  for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x) {
    codes[i] = ic::encode(m[i], scale);
    // __fsub_rn / __fadd_rn: never contracted into an FMA, so the result is
    // the CPU kernel's bit for bit (tests/python/test_int8_codec_cuda.py).
    if (p.e) p.e[i] = keep ? __fsub_rn(p.e[i], ic::decode(codes[i], scale)) : 0.0f;
  }
  if (threadIdx.x == 0) {
    reinterpret_cast<float*>(p.out + ic::scales_offset(p.map.numel))[c] = scale;
    if (c == 0) {
      for (int64_t i = p.map.numel; i < ic::scales_offset(p.map.numel); ++i) p.out[i] = 0;
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

// Element i (of chunk c) decoded from every row and summed in row order, as
// on the CPU; off: the rows' scales offset.
__device__ void unpack_sum_element(const UnpackParams& p, int64_t i, int64_t c, int64_t off) {
  float acc = 0.0f;
  for (int64_t r = 0; r < p.rows; ++r) {
    const uint8_t* row = p.packed + r * p.len;
    const float s = __fmul_rn(reinterpret_cast<const float*>(row + off)[c], p.alpha);
    acc = __fadd_rn(acc, ic::decode(reinterpret_cast<const int8_t*>(row)[i], s));
  }
  p.y[i] = acc;
}

// Uniform chunks: grid-stride over elements.
__global__ void unpack_sum_kernel(UnpackParams p) {
  const int64_t off = ic::scales_offset(p.numel);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    unpack_sum_element(p, i, i / p.chunk, off);
  }
}

// Per-part chunks: one block per chunk, its bounds from the table.
__global__ void unpack_sum_parts_kernel(UnpackParams p, const int64_t* bounds) {
  const int64_t c = blockIdx.x;
  const int64_t off = ic::scales_offset(p.numel);
  for (int64_t i = bounds[c] + threadIdx.x; i < bounds[c + 1]; i += blockDim.x) {
    unpack_sum_element(p, i, c, off);
  }
}

// The chunk table on the device: staged through pinned memory and copied on
// the current stream (the caching host allocator keeps the staging buffer
// until the copy is done). Empty bounds: an undefined tensor.
at::Tensor device_bounds(const std::vector<int64_t>& bounds, const at::Device& device) {
  if (bounds.empty()) return {};
  auto host = at::empty({static_cast<int64_t>(bounds.size())},
                        at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(bounds.begin(), bounds.end(), host.data_ptr<int64_t>());
  return host.to(device, /*non_blocking=*/true);
}

void check_args(const at::Tensor& t, at::ScalarType st, int64_t dim, const char* arg,
                int64_t chunk) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == st && t.dim() == dim && t.is_contiguous(), arg,
              " must be a ", dim, "-D contiguous CUDA ", st, " tensor, got ", t.dim(), "-D ",
              t.scalar_type(), " on ", t.device());
  TORCH_CHECK(chunk > 0, "chunk must be positive, got ", chunk);
}

at::Tensor pack(const at::Tensor& input, float* residual, int64_t chunk,
                at::OptionalIntArrayRef parts) {
  const int64_t n = input.numel();
  const std::vector<int64_t> bounds = ic::chunk_bounds(parts, n, chunk);
  const int64_t chunks = ic::chunk_count(bounds, n, chunk);
  auto out = at::empty({ic::packed_bytes_for_chunks(n, chunks)}, input.options().dtype(at::kByte));
  if (chunks == 0) {
    out.zero_();  // only the alignment padding of an input of empty parts
    return out;
  }
  TORCH_CHECK(chunks <= INT32_MAX, "input has too many chunks (", chunks, ") for one launch");
  const at::Tensor table = device_bounds(bounds, input.device());
  PackParams p{input.data_ptr<float>(), residual, out.data_ptr<uint8_t>(),
               ic::ChunkMap{table.defined() ? table.data_ptr<int64_t>() : nullptr, chunk, n}};
  pack_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor int8_pack_cuda(const at::Tensor& input, int64_t chunk, at::OptionalIntArrayRef parts) {
  check_args(input, at::kFloat, 1, "input", chunk);
  c10::cuda::CUDAGuard guard(input.device());
  return pack(input, nullptr, chunk, parts);
}

at::Tensor int8_pack_ef_cuda(const at::Tensor& input, at::Tensor& residual, int64_t chunk,
                             at::OptionalIntArrayRef parts) {
  check_args(input, at::kFloat, 1, "input", chunk);
  check_args(residual, at::kFloat, 1, "residual", chunk);
  TORCH_CHECK(residual.numel() == input.numel() && residual.device() == input.device(),
              "residual must have input's ", input.numel(), " elements on ", input.device(),
              ", got ", residual.numel(), " on ", residual.device());
  c10::cuda::CUDAGuard guard(input.device());
  return pack(input, residual.data_ptr<float>(), chunk, parts);
}

at::Tensor& int8_unpack_sum_out_cuda(const at::Tensor& packed, int64_t numel, int64_t chunk,
                                     double alpha, at::OptionalIntArrayRef parts,
                                     at::Tensor& out) {
  check_args(packed, at::kByte, 2, "packed", chunk);
  int64_t chunks = 0;
  const std::vector<int64_t> bounds =
      ic::unpack_bounds(packed.size(1), numel, chunk, parts, &chunks);
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
  auto stream = at::cuda::getCurrentCUDAStream();
  if (bounds.empty()) {
    const int64_t blocks = std::min<int64_t>((numel + kThreads - 1) / kThreads, 65535 * 8);
    unpack_sum_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  } else {
    TORCH_CHECK(chunks <= INT32_MAX, "packed has too many chunks (", chunks, ") for one launch");
    const at::Tensor table = device_bounds(bounds, packed.device());
    unpack_sum_parts_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(
        p, table.data_ptr<int64_t>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor int8_unpack_sum_cuda(const at::Tensor& packed, int64_t numel, int64_t chunk,
                                double alpha, at::OptionalIntArrayRef parts) {
  auto out = at::empty({std::max<int64_t>(numel, 0)}, packed.options().dtype(at::kFloat));
  return int8_unpack_sum_out_cuda(packed, numel, chunk, alpha, parts, out);
}

TORCH_LIBRARY_IMPL(ddpx, CUDA, m) {
  m.impl("_int8_pack", &int8_pack_cuda);
  m.impl("_int8_pack_ef", &int8_pack_ef_cuda);
  m.impl("_int8_unpack_sum", &int8_unpack_sum_cuda);
  m.impl("_int8_unpack_sum.out", &int8_unpack_sum_out_cuda);
}

}  // namespace
}  // namespace ddpx
