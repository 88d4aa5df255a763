// CPU forward kernel of ddpx::tiled_conv2d: our direct and implicit-GEMM
// paths (tiled_conv2d_cpu.h) or ATen's convolution, as tiled_conv2d_path.h
// decides per shape; also the run-time choice of the vectorised loops (the
// backward lives in tiled_conv2d_backward_kernel.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>

#include "kernels/common/tiled_conv2d_aten.h"
#include "kernels/cpu/tiled_conv2d_cpu.h"
#include "kernels/cpu/tiled_conv2d_path.h"

namespace ddpx::detail::cpu {

const VecKernels& vec_kernels() {
  static const VecKernels* chosen = [] {
    __builtin_cpu_init();
    const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool has_avx512 =
        has_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    std::string want = "avx512";
    if (const char* env = std::getenv("DDPX_CPU_CAPABILITY")) want = env;
    for (auto& ch : want) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (want == "avx512" && has_avx512) return vec_kernels_AVX512();
    if ((want == "avx512" || want == "avx2") && has_avx2) return vec_kernels_AVX2();
    return vec_kernels_DEFAULT();
  }();
  return *chosen;
}

// libtorch_cpu exports MKL's per-thread control (the C entry that mkl_service.h
// maps mkl_set_num_threads_local to) when torch uses MKL; weak, so
// the plugin still loads against a torch built with another BLAS.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

SequentialBlasGuard::SequentialBlasGuard() {
  if (MKL_Set_Num_Threads_Local != nullptr) previous_ = MKL_Set_Num_Threads_Local(1);
}

SequentialBlasGuard::~SequentialBlasGuard() {
  // 0 restores "use the global setting", which is also what a fresh thread has.
  if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(previous_);
}

bool batch_parallel(int64_t tasks) {
  return !at::in_parallel_region() && tasks >= at::get_num_threads();
}

namespace {

// out: [n, cout, oh, ow] contiguous, uninitialised; bias: [cout] or nullptr.
// Each task writes the bias into its own rows right before accumulating, while
// they are in cache: these planes are memory-bound, and a separate fill pass
// over the output cost ~25% (seed 1024x1024, depthwise 56x56).
template <typename T>
void direct_forward(const CpuConv& p, const T* x, const T* wt, const T* bias, T* out) {
  const auto corr = vec_kernels().corr_rows<T>();
  const PlaneGeom g = forward_plane(p);
  const int64_t rows = direct_block_rows(p);
  const int64_t blocks = (p.oh + rows - 1) / rows;
  const bool banded = use_padded_band(g);
  // Tasks run in (sample, group, row block, output channel) order, so that a
  // thread's consecutive tasks read the same input rows: with one input
  // channel per group (LeNet's first layer, 6 filters per image) the
  // zero-padded band is built once for all of a group's output channels.
  const int64_t tasks = p.n * p.groups * blocks * p.cog;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> band;
    PlaneGeom bg{};
    const T* band_src = nullptr;  // the input plane and first row the band holds
    int64_t band_y0 = -1;
    for (int64_t t = begin; t < end; ++t) {
      int64_t r = t / p.cog;
      const int64_t blk = r % blocks;
      r /= blocks;
      const int64_t grp = r % p.groups, nn = r / p.groups, oc = grp * p.cog + t % p.cog;
      const int64_t y0 = blk * rows, y1 = std::min(p.oh, y0 + rows);
      T* o = out + (nn * p.cout + oc) * p.oh * p.ow;
      std::fill(o + y0 * p.ow, o + y1 * p.ow, bias != nullptr ? bias[oc] : T(0));
      for (int64_t icg = 0; icg < p.cig; ++icg) {
        const T* xin = x + (nn * p.c + grp * p.cig + icg) * p.h * p.w;
        const T* taps = wt + (oc * p.cig + icg) * p.kh * p.kw;
        if (!banded) {
          corr(g, xin, taps, o, y0, y1);
          continue;
        }
        if (xin != band_src || y0 != band_y0) {
          bg = padded_band(g, xin, y0, y1, band);
          band_src = xin;
          band_y0 = y0;
        }
        corr(bg, band.data(), taps, o + y0 * p.ow, 0, y1 - y0);
      }
    }
  });
}

// out: [n, cout, oh, ow] contiguous, already holding the bias (or zeros).
template <typename T>
void gemm_forward(const CpuConv& p, const at::Tensor& x, const at::Tensor& wt, at::Tensor& out) {
  const auto opts = x.options();
  const GemmTiling tl = gemm_tiling(p, sizeof(T), /*backward=*/false);
  const int64_t row_tiles = (p.oh + tl.rows - 1) / tl.rows;
  const int64_t tasks = p.groups * tl.chunks * row_tiles;
  const int64_t plane = p.oh * p.ow;
  const bool outer = batch_parallel(tasks);
  const bool direct_panel = panel_is_input(p) && tl.images == 1;
  const int64_t cols_max = tl.images * tl.rows * p.ow;
  T* xp = x.data_ptr<T>();
  T* wp = wt.data_ptr<T>();
  T* op = out.data_ptr<T>();
  auto run = [&](int64_t t, T* col, T* tmp) {
    const int64_t grp = t % p.groups, rest = t / p.groups;
    const int64_t chunk = rest / row_tiles, rt = rest % row_tiles;
    const int64_t n0 = chunk * tl.images, n1 = std::min(p.n, n0 + tl.images);
    const int64_t y0 = rt * tl.rows, y1 = std::min(p.oh, y0 + tl.rows);
    const int64_t pix = (y1 - y0) * p.ow, cols = (n1 - n0) * pix;
    const at::Tensor panel =
        input_panel(p, xp, grp, n0, n1, y0, y1, direct_panel, outer, col, opts);
    auto w_g = view2d(wp + grp * p.cog * p.kc, p.cog, p.kc, p.kc, opts);
    T* o_g = op + grp * p.cog * plane + y0 * p.ow;  // add nn * cout * plane per image
    if (n1 - n0 == 1) {
      view2d(o_g + n0 * p.cout * plane, p.cog, pix, plane, opts).addmm_(w_g, panel);
      return;
    }
    // Several images in one GEMM: their outputs are not one strided matrix,
    // so the product lands in tmp [cog, cols] and is added image by image.
    at::Tensor prod = view2d(tmp, p.cog, cols, cols, opts);
    at::mm_out(prod, w_g, panel);
    for (int64_t nn = n0; nn < n1; ++nn) {
      for (int64_t m = 0; m < p.cog; ++m) {
        T* dst = o_g + nn * p.cout * plane + m * plane;
        const T* src = tmp + m * cols + (nn - n0) * pix;
        for (int64_t q = 0; q < pix; ++q) dst[q] += src[q];
      }
    }
  };
  const int64_t col_elems = direct_panel ? 0 : p.kc * cols_max;
  const int64_t tmp_elems = tl.images > 1 ? p.cog * cols_max : 0;
  if (outer) {
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      SequentialBlasGuard sequential;
      std::vector<T> col(col_elems), tmp(tmp_elems);
      for (int64_t t = begin; t < end; ++t) run(t, col.data(), tmp.data());
    });
  } else {
    std::vector<T> col(col_elems), tmp(tmp_elems);
    for (int64_t t = 0; t < tasks; ++t) run(t, col.data(), tmp.data());
  }
}

at::Tensor forward_on(ConvPath path, const Conv2dShape& s, const at::Tensor& input,
                      const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                      int64_t groups) {
  const CpuConv p = make_cpu_conv(s);
  if (path == ConvPath::kAten) {
    return aten_conv2d_forward(s, input, weight, bias, stride, padding, dilation, groups);
  }
  const auto out_format = conv2d_output_memory_format(input, weight);

  // The kernels work on NCHW-contiguous data; a channels-last or strided input
  // is copied once (the cost is one pass over the input).
  const at::Tensor x = (s.unbatched ? input.unsqueeze(0) : input).contiguous();
  const at::Tensor wt = weight.contiguous();
  const bool has_bias = bias.has_value() && bias->defined();
  const at::Tensor b = has_bias ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty({p.n, p.cout, p.oh, p.ow}, x.options());
  if (path == ConvPath::kGemm) {
    // The GEMMs accumulate into the output. A fresh buffer in every case:
    // expand(...).contiguous() would alias the bias itself when the output is
    // [1, cout, 1, 1].
    if (has_bias) {
      out.copy_(b.view({1, p.cout, 1, 1}).expand_as(out));
    } else {
      out.zero_();
    }
  }
  if (out.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tiled_conv2d_cpu", [&] {
      if (path == ConvPath::kDirect) {
        direct_forward<scalar_t>(p, x.data_ptr<scalar_t>(), wt.data_ptr<scalar_t>(),
                                 has_bias ? b.data_ptr<scalar_t>() : nullptr,
                                 out.data_ptr<scalar_t>());
      } else {
        gemm_forward<scalar_t>(p, x, wt, out);
      }
    });
  }
  if (s.unbatched) return out.squeeze(0);
  return out_format == at::MemoryFormat::Contiguous ? out : out.contiguous(out_format);
}

at::Tensor tiled_conv2d_cpu(const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  const Conv2dShape s =
      check_tiled_conv2d_args(input, weight, bias, stride, padding, dilation, groups);
  const ConvPath path = choose_conv_path(s, input.scalar_type(), ConvPass::kForward);
  if (path != ConvPath::kMeasure) {
    return forward_on(path, s, input, weight, bias, stride, padding, dilation, groups);
  }
  return conv_tune<at::Tensor>(
      cpu_tune_key(s, input.scalar_type(), ConvPass::kForward), input.device(),
      kMeasuredPathCount, [&](int i) {
        return forward_on(kMeasuredPaths[i], s, input, weight, bias, stride, padding, dilation,
                          groups);
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpx, CPU, m) { m.impl("tiled_conv2d", TORCH_FN(tiled_conv2d_cpu)); }

}  // namespace ddpx::detail::cpu
