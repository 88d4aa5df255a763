// PowerSGD's passes over a matrix (kernels/common/powersgd.h): the argument
// checks, the CPU build matching ATen's capability, and ATen's mm/addmm on
// other devices.
#include "kernels/common/powersgd.h"

#include <ATen/ATen.h>

#include <string>

#include "kernels/cpu/powersgd_kernel.h"

namespace ddpx::kernels::powersgd {
namespace {

// ATEN_CPU_CAPABILITY=default lowers ATen and us alike.
const CpuPasses& cpu() {
  static const CpuPasses passes = [] {
    const std::string cap = at::get_cpu_capability();
    return cap == "AVX2" || cap == "AVX512" ? cpu_passes_avx2() : cpu_passes_default();
  }();
  return passes;
}

void check(const at::Tensor& t, int64_t rows, int64_t cols, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous() &&
                  t.size(0) == rows && t.size(1) == cols,
              "powersgd kernel: ", what, " must be a contiguous float32 [", rows, ", ", cols,
              "] matrix, got ", t.scalar_type(), " ", t.sizes(),
              t.is_contiguous() ? "" : " (non-contiguous)");
}

}  // namespace

void project(const at::Tensor& e, const at::Tensor& x, const at::Tensor& qt, const at::Tensor& p) {
  if (!e.is_cpu()) {
    if (x.defined()) e.add_(x);
    at::Tensor out = p;
    at::mm_out(out, e, qt.t());
    return;
  }
  Matrices a;
  a.rows = e.size(0), a.cols = e.size(1), a.r = qt.size(0);
  check(e, a.rows, a.cols, "e");
  if (x.defined()) check(x, a.rows, a.cols, "x");
  check(qt, a.r, a.cols, "qt");
  check(p, a.rows, a.r, "p");
  a.e = e.data_ptr<float>();
  a.x = x.defined() ? x.const_data_ptr<float>() : nullptr;
  a.qt = const_cast<float*>(qt.const_data_ptr<float>());  // read only here
  a.p = p.data_ptr<float>();
  cpu().project(a);
}

void back_project(const at::Tensor& m, const at::Tensor& p, const at::Tensor& qt) {
  if (!m.is_cpu()) {
    at::Tensor out = qt;
    at::mm_out(out, p.t(), m);
    return;
  }
  Matrices a;
  a.rows = m.size(0), a.cols = m.size(1), a.r = p.size(1);
  check(m, a.rows, a.cols, "m");
  check(p, a.rows, a.r, "p");
  check(qt, a.r, a.cols, "qt");
  a.e = const_cast<float*>(m.const_data_ptr<float>());  // read only here
  a.p = const_cast<float*>(p.const_data_ptr<float>());
  a.qt = qt.data_ptr<float>();
  cpu().back_project(a);
}

void expand(const at::Tensor& p, const at::Tensor& qt_mean, const at::Tensor& out,
            const at::Tensor& qt_local, const at::Tensor& e) {
  if (!out.is_cpu()) {
    at::Tensor o = out;
    at::mm_out(o, p, qt_mean);
    if (e.defined()) e.addmm_(p, qt_local, /*beta=*/1, /*alpha=*/-1);
    return;
  }
  Matrices a;
  a.rows = out.size(0), a.cols = out.size(1), a.r = p.size(1);
  check(p, a.rows, a.r, "p");
  check(qt_mean, a.r, a.cols, "qt_mean");
  check(out, a.rows, a.cols, "out");
  a.p = const_cast<float*>(p.const_data_ptr<float>());
  a.qt_mean = qt_mean.const_data_ptr<float>();
  a.out = out.data_ptr<float>();
  if (e.defined()) {
    check(qt_local, a.r, a.cols, "qt_local");
    check(e, a.rows, a.cols, "e");
    a.qt = const_cast<float*>(qt_local.const_data_ptr<float>());
    a.e = e.data_ptr<float>();
  }
  cpu().expand(a);
}

}  // namespace ddpx::kernels::powersgd
