// Direct-path inner loops, compiled once per CPU capability: CPU_CAPABILITY is
// DEFAULT, AVX2 or AVX512 (set by kernels/cpu/tiled_conv2d.cmake together with
// the matching -m flags), which also selects at::vec's implementation.
//
// Layout of the work in one output row (stride 1 horizontally):
//   [0, a)   left border: some taps fall left of the input -> checked scalar loop
//   [a, b)   interior: every tap is inside -> unchecked vector loop, 4 vectors
//            of outputs kept in registers across all taps (one load per FMA):
//            4 vectors of one row where the row is wide, else one vector of
//            each of 4 rows
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

// Rows y..y+R-1 (kernel rows [i0, i1) inside the input for each of them),
// unit-stride columns [x, b) of the interior: one vector of outputs per row in
// registers, R independent FMA chains (a narrow plane, e.g. 28 or 56 columns,
// has too few vectors per row to hide the FMA latency one row at a time), the
// last partial vector with masked loads.
template <typename T, int R>
void vec_rows(const PlaneGeom& g, const T* in, const T* taps, T* out, int64_t y, int64_t i0,
              int64_t i1, int64_t x, int64_t b) {
  using Vec = Vectorized<T>;
  constexpr int64_t V = Vec::size();
  for (; x < b; x += V) {
    const int64_t cnt = std::min<int64_t>(V, b - x);
    const bool full = cnt == V;
    Vec acc[R];
    for (int r = 0; r < R; ++r) {
      const T* o = out + (y + r) * g.ow + x;
      acc[r] = full ? Vec::loadu(o) : Vec::loadu(o, cnt);
    }
    for (int64_t i = i0; i < i1; ++i) {
      const T* t = taps + i * g.kw;
      const T* src0 = in + ((y * g.sh - g.ph) + i * g.dh) * g.w + x - g.pw;
      for (int64_t j = 0; j < g.kw; ++j) {
        const Vec wv(t[j]);
        const T* src = src0 + j * g.dw;
        for (int r = 0; r < R; ++r) {
          const T* s = src + r * g.sh * g.w;
          acc[r] = at::vec::fmadd(wv, full ? Vec::loadu(s) : Vec::loadu(s, cnt), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      T* o = out + (y + r) * g.ow + x;
      if (full) {
        acc[r].store(o);
      } else {
        acc[r].store(o, cnt);
      }
    }
  }
}

template <typename T>
void corr_rows(const PlaneGeom& g, const T* in, const T* taps, T* out, int64_t y0, int64_t y1) {
  using Vec = Vectorized<T>;
  constexpr int64_t V = Vec::size();
  constexpr int64_t U = 4;
  constexpr int R = 4;  // rows per block of vec_rows
  int64_t a, b;
  interior_cols(g, &a, &b);
  auto taps_of = [&](int64_t y, int64_t* i0, int64_t* i1) {
    valid_taps(y * g.sh - g.ph, g.kh, g.dh, g.h, i0, i1);
  };
  // Columns [x0, x1) of row y with bounds checks (the horizontal borders).
  auto checked = [&](int64_t y, int64_t i0, int64_t i1, int64_t x0, int64_t x1) {
    T* orow = out + y * g.ow;
    const int64_t oy = y * g.sh - g.ph;
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
  // Wide interiors: blocks of U vectors of one row (U independent chains);
  // returns the first column left over.
  auto wide = [&](int64_t y, int64_t i0, int64_t i1) {
    T* orow = out + y * g.ow;
    const int64_t oy = y * g.sh - g.ph;
    int64_t x = a;
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
    return x;
  };
  for (int64_t y = y0; y < y1;) {
    int64_t i0, i1;
    taps_of(y, &i0, &i1);
    if (i0 == i1) {
      ++y;
      continue;
    }
    // R rows at once when they read the same kernel rows (away from the
    // vertical borders) and the interior leaves columns after the wide blocks.
    bool block = g.sw == 1 && y + R <= y1 && (b - a) % (U * V) > 0;
    for (int r = 1; block && r < R; ++r) {
      int64_t j0, j1;
      taps_of(y + r, &j0, &j1);
      block = j0 == i0 && j1 == i1;
    }
    const int rows = block ? R : 1;
    int64_t x = a;
    for (int r = 0; r < rows; ++r) {
      checked(y + r, i0, i1, 0, a);
      if (g.sw == 1) x = wide(y + r, i0, i1);
      checked(y + r, i0, i1, b, g.ow);
    }
    if (g.sw == 1) {
      if (block) {
        vec_rows<T, R>(g, in, taps, out, y, i0, i1, x, b);
      } else {
        vec_rows<T, 1>(g, in, taps, out, y, i0, i1, x, b);
      }
    } else {
      // Strided interior: no bounds checks needed, the compiler vectorises
      // what it can.
      T* orow = out + y * g.ow;
      const int64_t oy = y * g.sh - g.ph;
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
    }
    y += rows;
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

// Border columns (x < a or x >= b) of weight_rows: checked, in double.
template <typename T>
void weight_border(const PlaneGeom& g, const T* grow, const T* irow, int64_t j, int64_t x0,
                   int64_t x1, double* s) {
  for (int64_t x = x0; x < x1; ++x) {
    const int64_t ix = x * g.sw - g.pw + j * g.dw;
    if (ix >= 0 && ix < g.w) *s += static_cast<double>(grow[x] * irow[ix]);
  }
}

// Filters up to 5x5 keep one vector of partial sums per tap across all rows
// of the block: each grad_output vector is loaded once for every tap, and the
// horizontal reduction happens once per tap and block instead of once per tap
// and row (which cost as much as the arithmetic on 28-56 column planes).
constexpr int64_t kMaxVecTaps = 25;

template <typename T>
void weight_rows(const PlaneGeom& g, const T* in, const T* gout, double* acc, int64_t y0,
                 int64_t y1) {
  using Vec = Vectorized<T>;
  constexpr int64_t V = Vec::size();
  int64_t a, b;
  interior_cols(g, &a, &b);
  const int64_t kk = g.kh * g.kw;
  const bool vec_taps = g.sw == 1 && kk <= kMaxVecTaps;
  Vec sums[kMaxVecTaps];
  for (int64_t t = 0; vec_taps && t < kk; ++t) sums[t] = Vec(T(0));
  for (int64_t y = y0; y < y1; ++y) {
    const T* grow = gout + y * g.ow;
    const int64_t oy = y * g.sh - g.ph;
    int64_t i0, i1;
    valid_taps(oy, g.kh, g.dh, g.h, &i0, &i1);
    if (vec_taps) {
      for (int64_t x = a; x < b; x += V) {
        const int64_t cnt = std::min<int64_t>(V, b - x);
        const bool full = cnt == V;
        const Vec gv = full ? Vec::loadu(grow + x) : Vec::loadu(grow + x, cnt);
        for (int64_t i = i0; i < i1; ++i) {
          const T* src = in + (oy + i * g.dh) * g.w + x - g.pw;
          for (int64_t j = 0; j < g.kw; ++j, src += g.dw) {
            Vec& s = sums[i * g.kw + j];
            s = at::vec::fmadd(gv, full ? Vec::loadu(src) : Vec::loadu(src, cnt), s);
          }
        }
      }
    }
    for (int64_t i = i0; i < i1; ++i) {
      const T* irow = in + (oy + i * g.dh) * g.w;
      for (int64_t j = 0; j < g.kw; ++j) {
        // Per row and tap, a float dot product of one row (<= a few thousand
        // terms) summed into double: accurate for the largest images.
        double s = vec_taps ? 0.0 : dot(grow + a, irow + a * g.sw - g.pw + j * g.dw, b - a, g.sw);
        weight_border(g, grow, irow, j, 0, a, &s);
        weight_border(g, grow, irow, j, b, g.ow, &s);
        acc[i * g.kw + j] += s;
      }
    }
  }
  for (int64_t t = 0; vec_taps && t < kk; ++t) {
    acc[t] += static_cast<double>(
        at::vec::vec_reduce_all<T>([](Vec& u, Vec& v) { return u + v; }, sums[t]));
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
