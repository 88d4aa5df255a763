// CUDA kernels of ddpx::tiled_conv2d and ddpx::_tiled_conv2d_backward: thin
// launch shells over the tile/index math of kernels/common/conv_tile.h (which
// the CPU tests drive by emulating blocks and threads).
//
// Forward: small square filters (3x3, 5x5, 7x7, stride 1 or 2) with few
// input channels per group (the seed's case, depthwise) take the small-filter
// kernels (conv_small_kernel.cu: taps in registers, kRows outputs per thread;
// channels_last depthwise in its own layout); other few-channel cases the
// general direct path (filter in __constant__ memory when it fits, input tile
// + halo in shared memory, one thread per output); an implicit-GEMM path with
// shared-memory tiles for the rest. Backward: the small-filter kernels where
// they serve (grad_input as a forward over grad_output or a gather,
// grad_weight as partial sums on the forward's blocks); elsewhere one thread
// per input element (gather form, no atomics) and grad_weight per tap in row
// runs (one block each), each then summed in order; grad_bias a reduction
// over (n, h, w).
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <mutex>
#include <tuple>
#include <type_traits>

#include "kernels/common/conv_tile.h"
#include "kernels/common/conv_tile_nhwc.h"
#include "kernels/common/conv_tile_small.h"
#include "kernels/common/tiled_conv2d_args.h"
#include "kernels/common/tiled_conv2d_aten.h"
#include "kernels/common/tiled_conv2d_cuda_path.h"
#include "kernels/cuda/conv_small_launch.h"
#include "kernels/cuda/conv_sum_partials.cuh"

namespace ddpx::detail::cuda {
namespace {

using tile::ConvGeom;

// Tile traits: the direct path's output tile, the GEMM path's block tiles.
constexpr int kTileH = 16, kTileW = 16;
constexpr int kBM = 64, kBN = 64, kBK = 16, kTM = 4, kTN = 4;
constexpr int kGemmThreads = (kBM / kTM) * (kBN / kTN);
constexpr int kReduceThreads = 256;
constexpr int64_t kMaxGridZ = 65535;

// Raw storage for the filter in the acc type (float or double), 16-byte aligned.
__constant__ float4 c_filter[tile::kConstFilterBytes / sizeof(float4)];

template <typename T>
struct FwdParams {
  const T* x;     // [n, c, h, w]
  const T* wt;    // [cout, cig, kh, kw]
  const T* bias;  // [cout] or nullptr
  T* out;         // [n, cout, oh, ow]
  ConvGeom g;
};

template <typename T, typename Acc, int TH, int TW, bool kFilterInConst>
__global__ void __launch_bounds__(TH* TW) direct_fwd_kernel(const FwdParams<T> p) {
  extern __shared__ float4 smem_raw[];  // float4: aligned for double too
  Acc* patch = reinterpret_cast<Acc*>(smem_raw);
  const ConvGeom& g = p.g;
  const int64_t ph_ = tile::patch_h(g, TH), pw_ = tile::patch_w(g, TW);
  Acc* wsh = patch + ph_ * pw_;  // this plane's filter slice when not in constant memory
  const int tid = threadIdx.y * TW + threadIdx.x;
  const int64_t kk = g.kh * g.kw;
  int64_t oy, ox;
  const bool valid =
      tile::tile_output(g, blockIdx.y, blockIdx.x, TH, TW, threadIdx.y, threadIdx.x, &oy, &ox);
  const int64_t iy0 = tile::patch_origin_y(g, blockIdx.y, TH);
  const int64_t ix0 = tile::patch_origin_x(g, blockIdx.x, TW);
  // z covers n*cout planes, striding when there are more than the grid allows.
  for (int64_t plane = blockIdx.z; plane < g.n * g.cout; plane += gridDim.z) {
    const int64_t nn = plane / g.cout, oc = plane % g.cout, grp = oc / g.cog;
    const Acc* taps;
    if constexpr (kFilterInConst) {
      taps = reinterpret_cast<const Acc*>(c_filter) + oc * g.cig * kk;
    } else {
      __syncthreads();  // the previous plane's threads are done with wsh
      for (int64_t e = tid; e < g.cig * kk; e += TH * TW) {
        wsh[e] = static_cast<Acc>(p.wt[oc * g.cig * kk + e]);
      }
      taps = wsh;
    }
    Acc acc = p.bias != nullptr ? static_cast<Acc>(p.bias[oc]) : Acc(0);
    for (int64_t icg = 0; icg < g.cig; ++icg) {
      __syncthreads();  // everyone is done reading the previous patch
      const T* src = p.x + (nn * g.c + grp * g.cig + icg) * g.h * g.w;
      tile::load_patch(src, g.h, g.w, iy0, ix0, ph_, pw_, patch, tid, TH * TW);
      __syncthreads();
      if (valid) acc += tile::patch_dot(g, patch, pw_, threadIdx.y, threadIdx.x, taps + icg * kk);
    }
    if (valid) p.out[((nn * g.cout + oc) * g.oh + oy) * g.ow + ox] = static_cast<T>(acc);
  }
}

template <typename T, typename Acc>
__global__ void __launch_bounds__(kGemmThreads) gemm_fwd_kernel(const FwdParams<T> p) {
  __shared__ Acc As[kBK][kBM];
  __shared__ Acc Bs[kBK][kBN];
  const ConvGeom& g = p.g;
  const int tid = threadIdx.x;
  const int tm = tid / (kBN / kTN), tn = tid % (kBN / kTN);
  const int64_t m0 = int64_t(blockIdx.y) * kBM, p0 = int64_t(blockIdx.x) * kBN;
  const int64_t kc = g.cig * g.kh * g.kw;
  for (int64_t grp = blockIdx.z; grp < g.groups; grp += gridDim.z) {
    Acc c[kTM][kTN] = {};
    for (int64_t k0 = 0; k0 < kc; k0 += kBK) {
      __syncthreads();
      tile::gemm_load_tiles<kBM, kBN, kBK>(g, p.x, p.wt, grp, m0, p0, k0, As, Bs, tid,
                                           kGemmThreads);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kBK; ++kk) {
        Acc a[kTM], b[kTN];
#pragma unroll
        for (int i = 0; i < kTM; ++i) a[i] = As[kk][tm * kTM + i];
#pragma unroll
        for (int j = 0; j < kTN; ++j) b[j] = Bs[kk][tn * kTN + j];
#pragma unroll
        for (int i = 0; i < kTM; ++i) {
#pragma unroll
          for (int j = 0; j < kTN; ++j) c[i][j] += a[i] * b[j];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
      const int64_t m = m0 + tm * kTM + i;
#pragma unroll
      for (int j = 0; j < kTN; ++j) {
        const int64_t off = tile::gemm_out_offset(g, grp, m, p0 + tn * kTN + j);
        if (off < 0) continue;
        const Acc b = p.bias != nullptr ? static_cast<Acc>(p.bias[grp * g.cog + m]) : Acc(0);
        p.out[off] = static_cast<T>(c[i][j] + b);
      }
    }
  }
}

template <typename T, typename Acc>
__global__ void grad_input_kernel(const ConvGeom g, const T* go, const T* wt, T* gx) {
  const int64_t total = g.n * g.c * g.h * g.w;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t x = e % g.w, y = (e / g.w) % g.h, c = (e / (g.w * g.h)) % g.c;
    const int64_t nn = e / (g.w * g.h * g.c);
    gx[e] = static_cast<T>(tile::grad_input_element<T, Acc>(g, go, wt, nn, c, y, x));
  }
}

// Block (split, tap): the partial sum of tap `tap` over its run of rows
// (tile::grad_weight_run), into partial[tap * splits + split].
template <typename T, typename Acc>
__global__ void __launch_bounds__(kReduceThreads)
    grad_weight_runs_kernel(const ConvGeom g, const T* go, const T* x, int64_t splits,
                            Acc* partial) {
  __shared__ Acc part[kReduceThreads];
  const int64_t taps = g.cout * g.cig * g.kh * g.kw;
  int64_t begin, end;
  tile::grad_weight_run(g, blockIdx.x, splits, &begin, &end);
  for (int64_t tap = blockIdx.y; tap < taps; tap += gridDim.y) {
    part[threadIdx.x] =
        tile::grad_weight_rows<T, Acc>(g, go, x, tap, begin, end, threadIdx.x, kReduceThreads);
    __syncthreads();
    for (int half = kReduceThreads / 2; half > 0; half /= 2) {
      if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
      __syncthreads();
    }
    if (threadIdx.x == 0) partial[tap * splits + blockIdx.x] = part[0];
    __syncthreads();  // part[0] is read before the next tap overwrites it
  }
}

// c_filter is one per device: a copy into it must wait until the last kernel
// that read it (on any stream) is done. Each device keeps the event recorded
// after that kernel; the lock keeps copy -> launch -> record in one piece.
struct ConstFilterSlot {
  std::mutex mu;
  cudaEvent_t last_use = nullptr;
};
ConstFilterSlot& const_filter_slot(c10::DeviceIndex device) {
  static ConstFilterSlot slots[64];
  TORCH_INTERNAL_ASSERT(device >= 0 && device < 64);
  return slots[device];
}

template <typename T, typename Acc>
void launch_forward(const ConvGeom& g, const at::Tensor& x, const at::Tensor& wt,
                    const at::Tensor& bias, at::Tensor& out, cudaStream_t stream) {
  const FwdParams<T> p{x.data_ptr<T>(), wt.data_ptr<T>(),
                       bias.defined() ? bias.data_ptr<T>() : nullptr, out.data_ptr<T>(), g};
  if (small_forward<T, Acc>(g, x, wt, bias, out, stream)) return;  // conv_small_kernel.cu
  const int64_t smem_limit = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlock;
  if (tile::direct_can_implement(g, kTileH, kTileW, sizeof(Acc), smem_limit)) {
    const auto grid = tile::direct_grid(g, kTileH, kTileW);
    const dim3 blocks(grid.tiles_x, grid.tiles_y, std::min(grid.planes, kMaxGridZ));
    const dim3 threads(kTileW, kTileH);
    // Under graph capture the slot's event cannot order the copy (a capture
    // may not wait on an event recorded outside it, nor later work on one
    // recorded inside): the filter goes through shared memory there
    // (direct_can_implement counts it in).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture == cudaStreamCaptureStatusNone &&
        tile::filter_fits_constant(wt.numel(), sizeof(Acc))) {
      const at::Tensor filt = wt.to(c10::CppTypeToScalarType<Acc>::value).contiguous();
      const size_t smem = tile::direct_smem_bytes(g, kTileH, kTileW, sizeof(Acc), true);
      auto& slot = const_filter_slot(x.get_device());
      std::lock_guard<std::mutex> lock(slot.mu);
      if (slot.last_use == nullptr) {
        C10_CUDA_CHECK(cudaEventCreateWithFlags(&slot.last_use, cudaEventDisableTiming));
      } else {
        C10_CUDA_CHECK(cudaStreamWaitEvent(stream, slot.last_use, 0));
      }
      C10_CUDA_CHECK(cudaMemcpyToSymbolAsync(c_filter, filt.data_ptr<Acc>(),
                                             filt.numel() * sizeof(Acc), 0,
                                             cudaMemcpyDeviceToDevice, stream));
      direct_fwd_kernel<T, Acc, kTileH, kTileW, true><<<blocks, threads, smem, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      C10_CUDA_CHECK(cudaEventRecord(slot.last_use, stream));
    } else {
      const size_t smem = tile::direct_smem_bytes(g, kTileH, kTileW, sizeof(Acc), false);
      direct_fwd_kernel<T, Acc, kTileH, kTileW, false><<<blocks, threads, smem, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return;
  }
  const dim3 blocks(tile::ceil_div(g.n * g.oh * g.ow, kBN), tile::ceil_div(g.cog, kBM),
                    std::min(g.groups, kMaxGridZ));
  TORCH_CHECK(blocks.y <= kMaxGridZ, "tiled_conv2d: out_channels/groups too large for CUDA (",
              g.cog, ")");
  gemm_fwd_kernel<T, Acc><<<blocks, kGemmThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The choice for a pass; a pass to be measured under CUDA graph capture (no
// syncs allowed) takes the fixed rule instead.
Choice choose_here(const Conv2dShape& s, const at::Tensor& input, Pass pass) {
  const Choice c = choose(s, input.device(), input.scalar_type(), pass);
  if (c != Choice::kMeasure) return c;
  const c10::cuda::CUDAGuard device_guard(input.device());
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
    return c;
  }
  return rule_aten(s, input.scalar_type(), pass) ? Choice::kAten : Choice::kOurs;
}

// Whether a channels_last pass takes the NHWC depthwise kernels
// (conv_tile_nhwc.h) rather than NCHW copies in and out.
bool use_nhwc(const Conv2dShape& s, const ConvGeom& g, at::MemoryFormat fmt) {
  return !s.unbatched && fmt == at::MemoryFormat::ChannelsLast && tile::nhwc_depthwise(g);
}

at::Tensor ours_forward(const Conv2dShape& s, const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  const c10::cuda::CUDAGuard device_guard(input.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const ConvGeom g = conv_geom(s);
  const auto fmt = conv2d_output_memory_format(input, weight);
  const bool nhwc = use_nhwc(s, g, fmt);
  at::Tensor out = at::empty({g.n, g.cout, g.oh, g.ow},
                             input.options().memory_format(nhwc ? fmt : at::MemoryFormat::Contiguous));
  if (out.numel() > 0) {
    const at::Tensor x = nhwc ? input.contiguous(fmt)
                              : (s.unbatched ? input.unsqueeze(0) : input).contiguous();
    const at::Tensor wt = weight.contiguous();
    const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, x.scalar_type(), "tiled_conv2d_cuda", [&] {
          using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
          if (nhwc) {
            nhwc_forward<scalar_t, acc_t>(g, x, wt, b, out, stream);  // (use_nhwc: it serves g)
          } else {
            launch_forward<scalar_t, acc_t>(g, x, wt, b, out, stream);
          }
        });
  }
  if (s.unbatched) return out.squeeze(0);
  return fmt == at::MemoryFormat::Contiguous || nhwc ? out : out.contiguous(fmt);
}

at::Tensor tiled_conv2d_cuda(const at::Tensor& input, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                             at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  const Conv2dShape s =
      check_tiled_conv2d_args(input, weight, bias, stride, padding, dilation, groups);
  // Where cuDNN wins (kernels/common/tiled_conv2d_cuda_path.h), or measured.
  const auto on = [&](Choice c) {
    return c == Choice::kAten
               ? aten_conv2d_forward(s, input, weight, bias, stride, padding, dilation, groups)
               : ours_forward(s, input, weight, bias);
  };
  const Choice c = choose_here(s, input, Pass::kForward);
  if (c != Choice::kMeasure) return on(c);
  return conv_tune<at::Tensor>(cuda_tune_key(s, input.device(), input.scalar_type(), Pass::kForward),
                               input.device(), 2, [&](int i) { return on(static_cast<Choice>(i)); });
}

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

Grads ours_backward(const Conv2dShape& s, const at::Tensor& grad_output, const at::Tensor& input,
                    const at::Tensor& weight, std::array<bool, 3> output_mask) {
  const c10::cuda::CUDAGuard device_guard(input.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const ConvGeom g = conv_geom(s);
  const auto fmt = conv2d_output_memory_format(input, weight);
  const bool nhwc = use_nhwc(s, g, fmt);
  const auto layout = nhwc ? fmt : at::MemoryFormat::Contiguous;
  const at::Tensor x = (s.unbatched ? input.unsqueeze(0) : input).contiguous(layout);
  const at::Tensor go = (s.unbatched ? grad_output.unsqueeze(0) : grad_output).contiguous(layout);
  const at::Tensor wt = weight.contiguous();
  // Every kernel below writes its whole gradient; with no grad_output
  // (an empty batch or plane) the gradients are zeros.
  const bool run = go.numel() > 0;
  const auto alloc = [&](const at::Tensor& like, at::MemoryFormat f) {
    return run ? at::empty_like(like, f) : at::zeros_like(like, f);
  };
  at::Tensor gx, gw, gb;
  if (output_mask[0]) gx = alloc(x, layout);
  if (output_mask[1]) gw = alloc(wt, at::MemoryFormat::Contiguous);
  if (output_mask[2]) gb = go.sum({0, 2, 3});
  // An empty gradient launches nothing (a grid of 0 blocks is an invalid
  // configuration): no input channels, or an empty plane under padding.
  const bool want_gx = gx.defined() && gx.numel() > 0, want_gw = gw.defined() && gw.numel() > 0;
  if (run && (want_gx || want_gw)) {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, x.scalar_type(), "tiled_conv2d_backward_cuda", [&] {
          using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
          if (nhwc) {  // (use_nhwc: these serve g)
            if (want_gx) nhwc_grad_input<scalar_t, acc_t>(g, go, wt, gx, stream);
            if (want_gw) nhwc_grad_weight<scalar_t, acc_t>(g, go, x, gw, stream);
            return;
          }
          if (want_gx && !small_grad_input<scalar_t, acc_t>(g, go, wt, gx, stream)) {
            const int threads = 256;
            const int64_t blocks = std::min<int64_t>(tile::ceil_div(gx.numel(), threads), 65535);
            grad_input_kernel<scalar_t, acc_t><<<blocks, threads, 0, stream>>>(
                g, go.data_ptr<scalar_t>(), wt.data_ptr<scalar_t>(), gx.data_ptr<scalar_t>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          }
          if (want_gw && !small_grad_weight<scalar_t, acc_t>(g, go, x, gw, stream)) {
            // (25 taps get ~40 runs each on an H200.)
            const int64_t splits = tile::grad_weight_splits(g, grad_weight_target_blocks());
            const int64_t taps = gw.numel();
            at::Tensor partial = at::empty({taps * splits}, x.options().dtype(
                                                                 c10::CppTypeToScalarType<acc_t>::value));
            const dim3 blocks(splits, std::min<int64_t>(taps, kMaxGridZ));
            grad_weight_runs_kernel<scalar_t, acc_t><<<blocks, kReduceThreads, 0, stream>>>(
                g, go.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), splits,
                partial.data_ptr<acc_t>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
            launch_sum<scalar_t, acc_t>(partial, taps, splits, gw, stream);
          }
        });
  }
  if (gx.defined()) gx = s.unbatched ? gx.squeeze(0) : gx.contiguous(fmt);
  if (gw.defined()) gw = gw.contiguous(fmt);
  return {gx, gw, gb};
}

Grads tiled_conv2d_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                 const at::Tensor& weight, at::IntArrayRef stride,
                                 at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                                 std::array<bool, 3> output_mask) {
  const Conv2dShape s = check_tiled_conv2d_backward_args(grad_output, input, weight, stride,
                                                         padding, dilation, groups);
  const auto on = [&](Choice c) {
    return c == Choice::kAten ? aten_conv2d_backward(s, grad_output, input, weight, stride,
                                                     padding, dilation, groups, output_mask)
                              : ours_backward(s, grad_output, input, weight, output_mask);
  };
  const Choice c = choose_here(s, input, Pass::kBackward);
  if (c != Choice::kMeasure) return on(c);
  return conv_tune<Grads>(cuda_tune_key(s, input.device(), input.scalar_type(), Pass::kBackward),
                          input.device(), 2, [&](int i) { return on(static_cast<Choice>(i)); });
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpx, CUDA, m) {
  m.impl("tiled_conv2d", TORCH_FN(tiled_conv2d_cuda));
  m.impl("_tiled_conv2d_backward", TORCH_FN(tiled_conv2d_backward_cuda));
}

}  // namespace ddpx::detail::cuda
