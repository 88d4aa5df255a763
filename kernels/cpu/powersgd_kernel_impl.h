// PowerSGD's CPU passes over a matrix (kernels/common/powersgd.h), included
// once per instruction set by powersgd_kernel_{default,avx2}.cpp with
// DDPX_POWERSGD_FN naming the table it defines. Vectors of 8 floats (GCC
// vector types: two SSE registers in the default build, one AVX register in
// the AVX2 one). Each output element is a sum whose terms and order follow
// from indices alone: lane l of a dot product adds the columns j = l mod 8 in
// increasing j and the lanes are added in one fixed tree; Q^T's elements add
// the rows in order; the result's add k = 0, 1, ... Nothing depends on where
// a matrix starts in memory, so a tensor packed at another offset of a bucket
// gives the same bits. (The AVX2 build contracts a * b + c into one FMA, the
// default one does not: the two give different bits, each the same on every
// call.)
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

// vf values pass between this file's own inline helpers only, never across
// a library boundary, so GCC's note that 32-byte vectors are passed
// differently with and without AVX does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

#include "kernels/cpu/powersgd_kernel.h"

namespace ddpx::kernels::powersgd {
namespace {

using vf = float __attribute__((vector_size(32)));
constexpr int64_t kW = 8;  // floats per vf
// About 64 KiB of matrix per parallel task.
constexpr int64_t kGrainElements = 1 << 14;

inline vf ld(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void st(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float a) { return vf{} + a; }
// The n < kW floats at p, zeros after them.
inline vf ld_tail(const float* p, int64_t n) {
  float buf[kW] = {};
  std::memcpy(buf, p, n * sizeof(float));
  return ld(buf);
}
inline float lanes_sum(vf a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

int64_t grain_rows(int64_t cols) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, cols));
}

// P[i, k0..k0+4) = M[i, :] . Q^T[k, :] for one row; q[] of unused k point at
// a used row (their sums are computed and dropped).
void dots4(const float* row, int64_t cols, const float* const q[4], float out[4]) {
  vf a0{}, a1{}, a2{}, a3{};
  int64_t j = 0;
  for (; j + kW <= cols; j += kW) {
    const vf m = ld(row + j);
    a0 += m * ld(q[0] + j);
    a1 += m * ld(q[1] + j);
    a2 += m * ld(q[2] + j);
    a3 += m * ld(q[3] + j);
  }
  if (j < cols) {
    const int64_t n = cols - j;
    const vf m = ld_tail(row + j, n);
    a0 += m * ld_tail(q[0] + j, n);
    a1 += m * ld_tail(q[1] + j, n);
    a2 += m * ld_tail(q[2] + j, n);
    a3 += m * ld_tail(q[3] + j, n);
  }
  out[0] = lanes_sum(a0);
  out[1] = lanes_sum(a1);
  out[2] = lanes_sum(a2);
  out[3] = lanes_sum(a3);
}

void project(const Matrices& a) {
  const int64_t rows = a.rows, cols = a.cols, r = a.r;
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = a.e + i * cols;
      if (a.x) {  // M = e + x, in e; the row stays in cache for the products
        const float* xr = a.x + i * cols;
        int64_t j = 0;
        for (; j + kW <= cols; j += kW) st(row + j, ld(row + j) + ld(xr + j));
        for (; j < cols; ++j) row[j] += xr[j];
      }
      for (int64_t k0 = 0; k0 < r; k0 += 4) {
        const float* q[4];
        for (int64_t k = 0; k < 4; ++k) q[k] = a.qt + std::min(k0 + k, r - 1) * cols;
        float out[4];
        dots4(row, cols, q, out);
        for (int64_t k = k0; k < std::min(k0 + 4, r); ++k) a.p[i * r + k] = out[k - k0];
      }
    }
  });
}

// Q^T[k, j0..j0+kW*C) over every row, for k in [k0, k0 + 4), in registers.
template <int C>
void back_block(const Matrices& a, int64_t k0, int64_t j0) {
  const int64_t cols = a.cols, r = a.r;
  vf acc[4][C] = {};
  for (int64_t i = 0; i < a.rows; ++i) {
    const float* mr = a.e + i * cols + j0;
    vf m[C];
    for (int c = 0; c < C; ++c) m[c] = ld(mr + c * kW);
    for (int64_t k = 0; k < 4; ++k) {
      const vf pk = splat(a.p[i * r + std::min(k0 + k, r - 1)]);
      for (int c = 0; c < C; ++c) acc[k][c] += pk * m[c];
    }
  }
  for (int64_t k = k0; k < std::min(k0 + 4, r); ++k) {
    for (int c = 0; c < C; ++c) st(a.qt + k * cols + j0 + c * kW, acc[k - k0][c]);
  }
}

void back_project(const Matrices& a) {
  const int64_t rows = a.rows, cols = a.cols, r = a.r;
  constexpr int64_t kBlock = 2 * kW;  // columns per task unit: 8 accumulators
  const int64_t blocks = cols / kBlock;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, rows * kBlock));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t k0 = 0; k0 < r; k0 += 4) back_block<2>(a, k0, b * kBlock);
    }
  });
  int64_t j = blocks * kBlock;
  if (j + kW <= cols) {
    for (int64_t k0 = 0; k0 < r; k0 += 4) back_block<1>(a, k0, j);
    j += kW;
  }
  for (; j < cols; ++j) {  // the last columns: one at a time, rows in order
    for (int64_t k = 0; k < r; ++k) {
      float s = 0;
      for (int64_t i = 0; i < rows; ++i) s += a.p[i * r + k] * a.e[i * cols + j];
      a.qt[k * cols + j] = s;
    }
  }
}

void expand(const Matrices& a) {
  const int64_t cols = a.cols, r = a.r;
  at::parallel_for(0, a.rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* pr = a.p + i * r;
      float* o = a.out + i * cols;
      float* er = a.e ? a.e + i * cols : nullptr;  // the residual's row
      // sum over k of P[i, k] Q^T[k, j], k in order, for 8 columns at j.
      auto row_sum = [&](const float* qt, int64_t j) {
        vf s = splat(pr[0]) * ld(qt + j);
        for (int64_t k = 1; k < r; ++k) s += splat(pr[k]) * ld(qt + k * cols + j);
        return s;
      };
      int64_t j = 0;
      for (; j + kW <= cols; j += kW) {
        st(o + j, row_sum(a.qt_mean, j));
        if (er) st(er + j, ld(er + j) - row_sum(a.qt, j));  // e -= P Ql^T
      }
      for (; j < cols; ++j) {
        float s = pr[0] * a.qt_mean[j];
        for (int64_t k = 1; k < r; ++k) s += pr[k] * a.qt_mean[k * cols + j];
        o[j] = s;
        if (!er) continue;
        float t = pr[0] * a.qt[j];
        for (int64_t k = 1; k < r; ++k) t += pr[k] * a.qt[k * cols + j];
        er[j] -= t;
      }
    }
  });
}

}  // namespace

CpuPasses DDPX_POWERSGD_FN() { return {&project, &back_project, &expand}; }

}  // namespace ddpx::kernels::powersgd
