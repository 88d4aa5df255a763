// PowerSGD's passes over a matrix (kernels/common/powersgd.h): CPU loops
// whose per-element summation order depends on indices only, and ATen's
// mm/addmm elsewhere. The inner loops keep kLanes independent partial sums
// (j mod kLanes) so the compiler vectorizes them without reassociating
// anything, and add the lanes up in one fixed order.
#include "kernels/common/powersgd.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>

namespace ddpx::kernels::powersgd {
namespace {

constexpr int64_t kLanes = 8;  // dot()'s final sum names each lane
// Columns per block of back_project's tasks and of expand's row buffer.
constexpr int64_t kBlock = 512;
// About 64 KiB of matrix per parallel task.
constexpr int64_t kGrainElements = 1 << 14;

float dot(const float* a, const float* b, int64_t n) {
  std::array<float, kLanes> acc{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += a[j + l] * b[j + l];
  }
  for (int64_t l = 0; j + l < n; ++l) acc[l] += a[j + l] * b[j + l];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

void check(const at::Tensor& t, int64_t rows, int64_t cols, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous() &&
                  t.size(0) == rows && t.size(1) == cols,
              "powersgd kernel: ", what, " must be a contiguous float32 [", rows, ", ", cols,
              "] matrix, got ", t.scalar_type(), " ", t.sizes(),
              t.is_contiguous() ? "" : " (non-contiguous)");
}

int64_t grain_rows(int64_t cols) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, cols));
}

}  // namespace

void project(const at::Tensor& e, const at::Tensor& x, const at::Tensor& qt, const at::Tensor& p) {
  const int64_t rows = e.size(0), cols = e.size(1), r = qt.size(0);
  if (!e.is_cpu()) {
    if (x.defined()) e.add_(x);
    at::Tensor out = p;
    at::mm_out(out, e, qt.t());
    return;
  }
  check(e, rows, cols, "e");
  if (x.defined()) check(x, rows, cols, "x");
  check(qt, r, cols, "qt");
  check(p, rows, r, "p");
  float* ep = e.data_ptr<float>();
  const float* xp = x.defined() ? x.const_data_ptr<float>() : nullptr;
  const float* qp = qt.const_data_ptr<float>();
  float* pp = p.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = ep + i * cols;
      if (xp) {  // M = e + x, in e; the row stays in cache for the products
        const float* xr = xp + i * cols;
        for (int64_t j = 0; j < cols; ++j) row[j] += xr[j];
      }
      for (int64_t k = 0; k < r; ++k) pp[i * r + k] = dot(row, qp + k * cols, cols);
    }
  });
}

void back_project(const at::Tensor& m, const at::Tensor& p, const at::Tensor& qt) {
  const int64_t rows = m.size(0), cols = m.size(1), r = p.size(1);
  if (!m.is_cpu()) {
    at::Tensor out = qt;
    at::mm_out(out, p.t(), m);
    return;
  }
  check(m, rows, cols, "m");
  check(p, rows, r, "p");
  check(qt, r, cols, "qt");
  const float* mp = m.const_data_ptr<float>();
  const float* pp = p.const_data_ptr<float>();
  float* qp = qt.data_ptr<float>();
  // Column blocks are independent: each element of Q^T adds its rows in order.
  const int64_t blocks = (cols + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, rows * kBlock));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t j0 = b * kBlock, n = std::min(kBlock, cols - j0);
      for (int64_t k = 0; k < r; ++k) std::fill_n(qp + k * cols + j0, n, 0.0f);
      for (int64_t i = 0; i < rows; ++i) {
        const float* mr = mp + i * cols + j0;
        for (int64_t k = 0; k < r; ++k) {
          const float a = pp[i * r + k];
          float* q = qp + k * cols + j0;
          for (int64_t j = 0; j < n; ++j) q[j] += a * mr[j];
        }
      }
    }
  });
}

void expand(const at::Tensor& p, const at::Tensor& qt_mean, const at::Tensor& out,
            const at::Tensor& qt_local, const at::Tensor& e) {
  const int64_t rows = out.size(0), cols = out.size(1), r = p.size(1);
  if (!out.is_cpu()) {
    at::Tensor o = out;
    at::mm_out(o, p, qt_mean);
    if (e.defined()) e.addmm_(p, qt_local, /*beta=*/1, /*alpha=*/-1);
    return;
  }
  check(p, rows, r, "p");
  check(qt_mean, r, cols, "qt_mean");
  check(out, rows, cols, "out");
  if (e.defined()) {
    check(qt_local, r, cols, "qt_local");
    check(e, rows, cols, "e");
  }
  const float* pp = p.const_data_ptr<float>();
  const float* qm = qt_mean.const_data_ptr<float>();
  const float* ql = e.defined() ? qt_local.const_data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  float* ep = e.defined() ? e.data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::array<float, kBlock> sent{};
    for (int64_t i = begin; i < end; ++i) {
      const float* pr = pp + i * r;
      for (int64_t j0 = 0; j0 < cols; j0 += kBlock) {
        const int64_t n = std::min(kBlock, cols - j0);
        // The result: sum over k of P[i, k] Qm^T[k, j], k in order.
        float* o = op + i * cols + j0;
        std::fill_n(o, n, 0.0f);
        for (int64_t k = 0; k < r; ++k) {
          const float a = pr[k];
          const float* q = qm + k * cols + j0;
          for (int64_t j = 0; j < n; ++j) o[j] += a * q[j];
        }
        if (!ep) continue;
        // The residual: e minus what this rank's own Q carried.
        std::fill_n(sent.data(), n, 0.0f);
        for (int64_t k = 0; k < r; ++k) {
          const float a = pr[k];
          const float* q = ql + k * cols + j0;
          for (int64_t j = 0; j < n; ++j) sent[j] += a * q[j];
        }
        float* er = ep + i * cols + j0;
        for (int64_t j = 0; j < n; ++j) er[j] -= sent[j];
      }
    }
  });
}

}  // namespace ddpx::kernels::powersgd
