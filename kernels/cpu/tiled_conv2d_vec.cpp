// Direct-path inner loops, compiled once per CPU capability: CPU_CAPABILITY is
// DEFAULT, AVX2 or AVX512 (set by kernels/cpu/tiled_conv2d.cmake together with
// the matching -m flags), which also selects at::vec's implementation.
//
// Layout of the work in one output row (stride 1 horizontally):
//   [0, a)   left border: some taps fall left of the input -> checked scalar loop
//   [a, b)   interior: every tap is inside -> unchecked vector loop, 4 vectors
//            of outputs kept in registers across all taps (one load per FMA)
//   [b, ow)  right border -> checked scalar loop
// Rows are clipped to the kernel rows that land inside the input, so the
// vertical border costs nothing.
#include "kernels/cpu/tiled_conv2d_vec.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>

#ifndef CPU_CAPABILITY
#error "tiled_conv2d_vec.cpp must be compiled with -DCPU_CAPABILITY=<DEFAULT|AVX2|AVX512>"
#endif
#define DDPX_CONCAT_(a, b) a##b
#define DDPX_CONCAT(a, b) DDPX_CONCAT_(a, b)

namespace ddpx::detail::cpu {
namespace {

using at::vec::Vectorized;

int64_t ceil_div_nonneg(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Kernel rows [i0, i1) whose input row y*sh - ph + i*dh lies in [0, h).
void valid_taps(int64_t origin, int64_t k, int64_t d, int64_t n, int64_t* i0, int64_t* i1) {
  *i0 = origin >= 0 ? 0 : ceil_div_nonneg(-origin, d);
  *i1 = origin > n - 1 ? 0 : std::min<int64_t>(k, (n - 1 - origin) / d + 1);
  if (*i1 < *i0) *i1 = *i0;
}

// Output columns [a, b) where every horizontal tap is inside the input row.
void interior_cols(const PlaneGeom& g, int64_t* a, int64_t* b) {
  // x*sw - pw >= 0  and  x*sw - pw + (kw-1)*dw <= w-1
  const int64_t lo = g.pw <= 0 ? 0 : ceil_div_nonneg(g.pw, g.sw);
  const int64_t hi_num = g.w - 1 + g.pw - (g.kw - 1) * g.dw;
  const int64_t hi = hi_num < 0 ? 0 : hi_num / g.sw + 1;  // exclusive
  *a = std::min(lo, g.ow);
  *b = std::max(*a, std::min(hi, g.ow));
}

template <typename T>
void corr_rows(const PlaneGeom& g, const T* in, const T* taps, T* out, int64_t y0, int64_t y1) {
  using Vec = Vectorized<T>;
  constexpr int64_t V = Vec::size();
  constexpr int64_t U = 4;
  int64_t a, b;
  interior_cols(g, &a, &b);
  for (int64_t y = y0; y < y1; ++y) {
    T* orow = out + y * g.ow;
    const int64_t oy = y * g.sh - g.ph;
    int64_t i0, i1;
    valid_taps(oy, g.kh, g.dh, g.h, &i0, &i1);
    if (i0 == i1) continue;
    auto checked = [&](int64_t x0, int64_t x1) {
      for (int64_t x = x0; x < x1; ++x) {
        T s = orow[x];
        const int64_t ox = x * g.sw - g.pw;
        for (int64_t i = i0; i < i1; ++i) {
          const T* irow = in + (oy + i * g.dh) * g.w;
          for (int64_t j = 0; j < g.kw; ++j) {
            const int64_t ix = ox + j * g.dw;
            if (ix >= 0 && ix < g.w) s += taps[i * g.kw + j] * irow[ix];
          }
        }
        orow[x] = s;
      }
    };
    checked(0, a);
    int64_t x = a;
    if (g.sw == 1) {
      for (; x + U * V <= b; x += U * V) {
        Vec acc0 = Vec::loadu(orow + x), acc1 = Vec::loadu(orow + x + V);
        Vec acc2 = Vec::loadu(orow + x + 2 * V), acc3 = Vec::loadu(orow + x + 3 * V);
        for (int64_t i = i0; i < i1; ++i) {
          const T* src = in + (oy + i * g.dh) * g.w + x - g.pw;
          const T* t = taps + i * g.kw;
          for (int64_t j = 0; j < g.kw; ++j, src += g.dw) {
            const Vec wv(t[j]);
            acc0 = at::vec::fmadd(wv, Vec::loadu(src), acc0);
            acc1 = at::vec::fmadd(wv, Vec::loadu(src + V), acc1);
            acc2 = at::vec::fmadd(wv, Vec::loadu(src + 2 * V), acc2);
            acc3 = at::vec::fmadd(wv, Vec::loadu(src + 3 * V), acc3);
          }
        }
        acc0.store(orow + x);
        acc1.store(orow + x + V);
        acc2.store(orow + x + 2 * V);
        acc3.store(orow + x + 3 * V);
      }
      for (; x + V <= b; x += V) {
        Vec acc = Vec::loadu(orow + x);
        for (int64_t i = i0; i < i1; ++i) {
          const T* src = in + (oy + i * g.dh) * g.w + x - g.pw;
          const T* t = taps + i * g.kw;
          for (int64_t j = 0; j < g.kw; ++j, src += g.dw) {
            acc = at::vec::fmadd(Vec(t[j]), Vec::loadu(src), acc);
          }
        }
        acc.store(orow + x);
      }
      if (x < b) {  // the last partial vector of the interior (masked loads)
        const int64_t cnt = b - x;
        Vec acc = Vec::loadu(orow + x, cnt);
        for (int64_t i = i0; i < i1; ++i) {
          const T* src = in + (oy + i * g.dh) * g.w + x - g.pw;
          const T* t = taps + i * g.kw;
          for (int64_t j = 0; j < g.kw; ++j, src += g.dw) {
            acc = at::vec::fmadd(Vec(t[j]), Vec::loadu(src, cnt), acc);
          }
        }
        acc.store(orow + x, cnt);
        x = b;
      }
    }
    // Interior leftovers (and every interior column when strided): no bounds
    // checks needed, the compiler vectorises what it can.
    for (; x < b; ++x) {
      T s = orow[x];
      const int64_t ox = x * g.sw - g.pw;
      for (int64_t i = i0; i < i1; ++i) {
        const T* irow = in + (oy + i * g.dh) * g.w + ox;
        const T* t = taps + i * g.kw;
        for (int64_t j = 0; j < g.kw; ++j) s += t[j] * irow[j * g.dw];
      }
      orow[x] = s;
    }
    checked(b, g.ow);
  }
}

// sum_x p[x] * q[x * stride] over n elements, vectorised when stride == 1.
template <typename T>
double dot(const T* p, const T* q, int64_t n, int64_t stride) {
  using Vec = Vectorized<T>;
  constexpr int64_t V = Vec::size();
  int64_t x = 0;
  T s = 0;
  if (stride == 1) {
    Vec a0(0), a1(0), a2(0), a3(0);
    for (; x + 4 * V <= n; x += 4 * V) {
      a0 = at::vec::fmadd(Vec::loadu(p + x), Vec::loadu(q + x), a0);
      a1 = at::vec::fmadd(Vec::loadu(p + x + V), Vec::loadu(q + x + V), a1);
      a2 = at::vec::fmadd(Vec::loadu(p + x + 2 * V), Vec::loadu(q + x + 2 * V), a2);
      a3 = at::vec::fmadd(Vec::loadu(p + x + 3 * V), Vec::loadu(q + x + 3 * V), a3);
    }
    for (; x + V <= n; x += V) a0 = at::vec::fmadd(Vec::loadu(p + x), Vec::loadu(q + x), a0);
    if (x < n) {  // masked loads fill the missing lanes with zeros
      a1 = at::vec::fmadd(Vec::loadu(p + x, n - x), Vec::loadu(q + x, n - x), a1);
      x = n;
    }
    const Vec sum = (a0 + a1) + (a2 + a3);
    s = at::vec::vec_reduce_all<T>([](Vec& u, Vec& v) { return u + v; }, sum);
  }
  for (; x < n; ++x) s += p[x] * q[x * stride];
  return static_cast<double>(s);
}

template <typename T>
void weight_rows(const PlaneGeom& g, const T* in, const T* gout, double* acc, int64_t y0,
                 int64_t y1) {
  int64_t a, b;
  interior_cols(g, &a, &b);
  for (int64_t y = y0; y < y1; ++y) {
    const T* grow = gout + y * g.ow;
    const int64_t oy = y * g.sh - g.ph;
    int64_t i0, i1;
    valid_taps(oy, g.kh, g.dh, g.h, &i0, &i1);
    for (int64_t i = i0; i < i1; ++i) {
      const T* irow = in + (oy + i * g.dh) * g.w;
      for (int64_t j = 0; j < g.kw; ++j) {
        // Per row and tap, a float dot product of one row (<= a few thousand
        // terms) summed into double: accurate for the largest images.
        double s = dot(grow + a, irow + a * g.sw - g.pw + j * g.dw, b - a, g.sw);
        for (int64_t x = 0; x < a; ++x) {
          const int64_t ix = x * g.sw - g.pw + j * g.dw;
          if (ix >= 0 && ix < g.w) s += static_cast<double>(grow[x] * irow[ix]);
        }
        for (int64_t x = b; x < g.ow; ++x) {
          const int64_t ix = x * g.sw - g.pw + j * g.dw;
          if (ix >= 0 && ix < g.w) s += static_cast<double>(grow[x] * irow[ix]);
        }
        acc[i * g.kw + j] += s;
      }
    }
  }
}

}  // namespace

const VecKernels* DDPX_CONCAT(vec_kernels_, CPU_CAPABILITY)() {
#define DDPX_STR_(x) #x
#define DDPX_STR(x) DDPX_STR_(x)
  static const VecKernels table{DDPX_STR(CPU_CAPABILITY), &corr_rows<float>, &corr_rows<double>,
                                &weight_rows<float>, &weight_rows<double>};
  return &table;
}

}  // namespace ddpx::detail::cpu
