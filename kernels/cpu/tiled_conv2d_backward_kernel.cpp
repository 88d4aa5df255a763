// CPU kernel of ddpx::_tiled_conv2d_backward: grad_input, grad_weight and
// grad_bias, each only when its output_mask entry is set, by the path the
// forward took (tiled_conv2d_path.h): ATen's convolution_backward, or ours:
//
// Direct path (few input channels per group):
//  * grad_input with unit stride is a correlation of grad_output with the
//    flipped filter and padding (k-1)*d - p, so it reuses the forward's
//    vectorised loops; with larger strides it is a scatter per input plane.
//  * grad_weight: per (filter, sample, block of rows) partial dot products
//    (vectorised along rows, summed in double), then reduced in a fixed order
//    so the result does not depend on the thread count.
// Implicit-GEMM path, per (sample, group) and output tile:
//    grad_W_g[cog, kc]  += grad_out_tile[cog, pix] @ col[kc, pix]^T
//    colg[kc, pix]       = W_g[cog, kc]^T @ grad_out_tile[cog, pix]; col2im -> grad_x
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "kernels/common/tiled_conv2d_aten.h"
#include "kernels/cpu/tiled_conv2d_cpu.h"
#include "kernels/cpu/tiled_conv2d_path.h"

namespace ddpx::detail::cpu {
namespace {

// grad_x: [n, c, h, w], uninitialised: each task zeroes the rows it owns right
// before accumulating into them (a separate zero pass costs a full trip
// through memory on these memory-bound planes).
template <typename T>
void direct_grad_input(const CpuConv& p, const T* go, const at::Tensor& wt, T* gx) {
  const int64_t planes = p.n * p.c;
  if (p.sh == 1 && p.sw == 1) {
    const at::Tensor wflip = wt.flip({2, 3}).contiguous();
    const T* wf = wflip.data_ptr<T>();
    const auto corr = vec_kernels().corr_rows<T>();
    // Input plane = grad_output plane, output plane = grad_x plane.
    const PlaneGeom g{
        p.oh, p.ow, p.h, p.w, p.kh, p.kw, 1, 1, (p.kh - 1) * p.dh - p.ph, (p.kw - 1) * p.dw - p.pw,
        p.dh, p.dw};
    CpuConv q = p;  // block rows of the grad_x plane
    q.oh = p.h;
    q.ow = p.w;
    const int64_t rows = direct_block_rows(q);
    const int64_t blocks = (p.h + rows - 1) / rows;
    const bool banded = use_padded_band(g);
    at::parallel_for(0, planes * blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> band;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t plane = t / blocks, blk = t % blocks;
        const int64_t nn = plane / p.c, ic = plane % p.c;
        const int64_t grp = ic / p.cig, icg = ic % p.cig;
        const int64_t y0 = blk * rows, y1 = std::min(p.h, y0 + rows);
        std::fill(gx + (plane * p.h + y0) * p.w, gx + (plane * p.h + y1) * p.w, T(0));
        for (int64_t k = 0; k < p.cog; ++k) {
          const int64_t oc = grp * p.cog + k;
          const T* src = go + (nn * p.cout + oc) * p.oh * p.ow;
          const T* taps = wf + (oc * p.cig + icg) * p.kh * p.kw;
          if (banded) {
            corr_rows_banded(corr, g, src, taps, gx + plane * p.h * p.w, y0, y1, band);
          } else {
            corr(g, src, taps, gx + plane * p.h * p.w, y0, y1);
          }
        }
      }
    });
    return;
  }
  // Strided: scatter each grad_output pixel into the taps it came from. One
  // task owns one grad_x plane, so there are no write races.
  const T* w = wt.data_ptr<T>();
  at::parallel_for(0, planes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t plane = begin; plane < end; ++plane) {
      const int64_t nn = plane / p.c, ic = plane % p.c;
      const int64_t grp = ic / p.cig, icg = ic % p.cig;
      T* dst = gx + plane * p.h * p.w;
      std::fill(dst, dst + p.h * p.w, T(0));
      for (int64_t k = 0; k < p.cog; ++k) {
        const int64_t oc = grp * p.cog + k;
        const T* src = go + (nn * p.cout + oc) * p.oh * p.ow;
        const T* taps = w + (oc * p.cig + icg) * p.kh * p.kw;
        for (int64_t y = 0; y < p.oh; ++y) {
          for (int64_t i = 0; i < p.kh; ++i) {
            const int64_t iy = y * p.sh - p.ph + i * p.dh;
            if (iy < 0 || iy >= p.h) continue;
            T* drow = dst + iy * p.w;
            for (int64_t j = 0; j < p.kw; ++j) {
              const T tap = taps[i * p.kw + j];
              for (int64_t x = 0; x < p.ow; ++x) {
                const int64_t ix = x * p.sw - p.pw + j * p.dw;
                if (ix >= 0 && ix < p.w) drow[ix] += tap * src[y * p.ow + x];
              }
            }
          }
        }
      }
    }
  });
}

// grad_w: [cout, cig, kh, kw], written (not accumulated).
template <typename T>
void direct_grad_weight(const CpuConv& p, const T* x, const T* go, T* gw) {
  const auto wrows = vec_kernels().weight_rows<T>();
  const PlaneGeom g = forward_plane(p);
  const int64_t kk = p.kh * p.kw;
  const int64_t rows = direct_block_rows(p);
  const int64_t blocks = (p.oh + rows - 1) / rows;
  const int64_t per_filter = p.n * blocks;  // partial sums per (oc, icg)
  const int64_t filters = p.cout * p.cig;
  std::vector<double> partial(filters * per_filter * kk, 0.0);
  const bool banded = use_padded_band(g);
  at::parallel_for(0, filters * per_filter, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> band;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t f = t / per_filter, r = t % per_filter;
      const int64_t oc = f / p.cig, icg = f % p.cig, grp = oc / p.cog;
      const int64_t nn = r / blocks, blk = r % blocks;
      const int64_t y0 = blk * rows, y1 = std::min(p.oh, y0 + rows);
      const T* xin = x + (nn * p.c + grp * p.cig + icg) * p.h * p.w;
      const T* gin = go + (nn * p.cout + oc) * p.oh * p.ow;
      if (banded) {
        weight_rows_banded(wrows, g, xin, gin, partial.data() + t * kk, y0, y1, band);
      } else {
        wrows(g, xin, gin, partial.data() + t * kk, y0, y1);
      }
    }
  });
  for (int64_t f = 0; f < filters; ++f) {
    for (int64_t k = 0; k < kk; ++k) {
      double s = 0;
      for (int64_t r = 0; r < per_filter; ++r) s += partial[(f * per_filter + r) * kk + k];
      gw[f * kk + k] = static_cast<T>(s);
    }
  }
}

// gx (if defined): [n, c, h, w] zeros on entry; gw (if defined): [cout, cig, kh, kw] zeros.
template <typename T>
void gemm_backward(const CpuConv& p, const at::Tensor& x, const at::Tensor& go,
                   const at::Tensor& wt, at::Tensor& gx, at::Tensor& gw) {
  const auto opts = x.options();
  const GemmTiling tl = gemm_tiling(p, sizeof(T), /*backward=*/true);
  // A task owns whole images of one group: the col2im halos of its row tiles
  // overlap, so they run in order inside the task.
  const int64_t tasks = p.groups * tl.chunks;
  const int64_t plane = p.oh * p.ow;
  const bool outer = batch_parallel(tasks);
  const bool need_gx = gx.defined(), need_gw = gw.defined();
  const bool direct_panel = panel_is_input(p) && tl.images == 1;
  const int64_t cols_max = tl.images * tl.rows * p.ow;
  T* xp = x.data_ptr<T>();
  T* gop = go.data_ptr<T>();
  T* wp = wt.data_ptr<T>();
  T* gxp = need_gx ? gx.data_ptr<T>() : nullptr;

  auto run = [&](int64_t t, T* col, T* colg, T* gbuf, at::Tensor& gw_acc) {
    const int64_t grp = t % p.groups, chunk = t / p.groups;
    const int64_t n0 = chunk * tl.images, n1 = std::min(p.n, n0 + tl.images);
    auto gx_g = [&](int64_t nn) { return gxp + (nn * p.c + grp * p.cig) * p.h * p.w; };
    auto w_g = view2d(wp + grp * p.cog * p.kc, p.cog, p.kc, p.kc, opts);
    for (int64_t y0 = 0; y0 < p.oh; y0 += tl.rows) {
      const int64_t y1 = std::min(p.oh, y0 + tl.rows);
      const int64_t pix = (y1 - y0) * p.ow, cols = (n1 - n0) * pix;
      at::Tensor go_t;  // [cog, cols]
      if (n1 - n0 == 1) {
        go_t =
            view2d(gop + (n0 * p.cout + grp * p.cog) * plane + y0 * p.ow, p.cog, pix, plane, opts);
      } else {
        for (int64_t nn = n0; nn < n1; ++nn) {
          for (int64_t m = 0; m < p.cog; ++m) {
            std::memcpy(gbuf + m * cols + (nn - n0) * pix,
                        gop + (nn * p.cout + grp * p.cog + m) * plane, pix * sizeof(T));
          }
        }
        go_t = view2d(gbuf, p.cog, cols, cols, opts);
      }
      if (need_gw) {
        const at::Tensor panel =
            input_panel(p, xp, grp, n0, n1, y0, y1, direct_panel, outer, col, opts);
        gw_acc.narrow(0, grp * p.cog, p.cog).addmm_(go_t, panel.t());
      }
      if (need_gx) {
        if (direct_panel) {
          view2d(gx_g(n0) + y0 * p.ow, p.kc, pix, p.h * p.w, opts).addmm_(w_g.t(), go_t);
          continue;
        }
        at::Tensor cg = view2d(colg, p.kc, cols, cols, opts);
        at::mm_out(cg, w_g.t(), go_t);
        for (int64_t nn = n0; nn < n1; ++nn) {
          const T* src = colg + (nn - n0) * pix;
          if (outer) {
            col2im_tile_add(p, src, cols, y0, y1, gx_g(nn), 0, p.cig);
          } else {
            at::parallel_for(0, p.cig, 1, [&](int64_t c0, int64_t c1) {
              col2im_tile_add(p, src, cols, y0, y1, gx_g(nn), c0, c1);
            });
          }
        }
      }
    }
  };

  const int64_t col_elems = direct_panel ? 0 : p.kc * cols_max;
  const int64_t gbuf_elems = tl.images > 1 ? p.cog * cols_max : 0;
  if (outer) {
    // One grad_weight accumulator per worker thread, summed at the end.
    std::vector<at::Tensor> partial(at::get_num_threads());
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      SequentialBlasGuard sequential;
      std::vector<T> col(col_elems), colg(col_elems), gbuf(gbuf_elems);
      at::Tensor& acc = partial[at::get_thread_num()];
      if (need_gw && !acc.defined()) acc = at::zeros({p.cout, p.kc}, opts);
      for (int64_t t = begin; t < end; ++t) run(t, col.data(), colg.data(), gbuf.data(), acc);
    });
    if (need_gw) {
      auto flat = gw.view({p.cout, p.kc});
      for (auto& acc : partial) {
        if (acc.defined()) flat.add_(acc);
      }
    }
  } else {
    std::vector<T> col(col_elems), colg(col_elems), gbuf(gbuf_elems);
    at::Tensor acc = need_gw ? gw.view({p.cout, p.kc}) : at::Tensor();
    for (int64_t t = 0; t < tasks; ++t) run(t, col.data(), colg.data(), gbuf.data(), acc);
  }
}

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

Grads backward_on(ConvPath path, const Conv2dShape& s, const at::Tensor& grad_output,
                  const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
                  at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                  std::array<bool, 3> output_mask) {
  const CpuConv p = make_cpu_conv(s);
  if (path == ConvPath::kAten) {
    return aten_conv2d_backward(s, grad_output, input, weight, stride, padding, dilation, groups,
                                output_mask);
  }
  const auto fmt = conv2d_output_memory_format(input, weight);
  const at::Tensor x = (s.unbatched ? input.unsqueeze(0) : input).contiguous();
  const at::Tensor go = (s.unbatched ? grad_output.unsqueeze(0) : grad_output).contiguous();
  const at::Tensor wt = weight.contiguous();

  at::Tensor gx, gw, gb;
  if (output_mask[0]) {
    // The direct path zeroes grad_input itself; col2im accumulates into zeros.
    gx = path == ConvPath::kDirect ? at::empty_like(x, at::MemoryFormat::Contiguous)
                                   : at::zeros_like(x, at::MemoryFormat::Contiguous);
  }
  if (output_mask[1]) gw = at::zeros_like(wt, at::MemoryFormat::Contiguous);
  if (output_mask[2]) gb = go.sum({0, 2, 3});
  if (go.numel() > 0 && (gx.defined() || gw.defined())) {
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tiled_conv2d_backward_cpu", [&] {
      if (path == ConvPath::kDirect) {
        if (gx.defined()) {
          direct_grad_input<scalar_t>(p, go.data_ptr<scalar_t>(), wt, gx.data_ptr<scalar_t>());
        }
        if (gw.defined()) {
          direct_grad_weight<scalar_t>(p, x.data_ptr<scalar_t>(), go.data_ptr<scalar_t>(),
                                       gw.data_ptr<scalar_t>());
        }
      } else {
        gemm_backward<scalar_t>(p, x, go, wt, gx, gw);
      }
    });
  }
  // Gradients come back in the layout ATen's conv2d backward gives them.
  if (gx.defined()) gx = s.unbatched ? gx.squeeze(0) : gx.contiguous(fmt);
  if (gw.defined()) gw = gw.contiguous(fmt);
  return {gx, gw, gb};
}

Grads tiled_conv2d_backward_cpu(const at::Tensor& grad_output, const at::Tensor& input,
                                const at::Tensor& weight, at::IntArrayRef stride,
                                at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                                std::array<bool, 3> output_mask) {
  const Conv2dShape s = check_tiled_conv2d_backward_args(grad_output, input, weight, stride,
                                                         padding, dilation, groups);
  const ConvPath path = choose_conv_path(s, input.scalar_type(), ConvPass::kBackward);
  if (path != ConvPath::kMeasure) {
    return backward_on(path, s, grad_output, input, weight, stride, padding, dilation, groups,
                       output_mask);
  }
  return conv_tune<Grads>(cpu_tune_key(s, input.scalar_type(), ConvPass::kBackward),
                          input.device(), kMeasuredPathCount, [&](int i) {
                            return backward_on(kMeasuredPaths[i], s, grad_output, input, weight,
                                               stride, padding, dilation, groups, output_mask);
                          });
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpx, CPU, m) {
  m.impl("_tiled_conv2d_backward", TORCH_FN(tiled_conv2d_backward_cpu));
}

}  // namespace ddpx::detail::cpu
