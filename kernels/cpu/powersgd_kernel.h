#pragma once
// The CPU passes of PowerSGD (kernels/common/powersgd.h), built once per
// instruction set (powersgd_kernel_{default,avx2}.cpp from
// powersgd_kernel_impl.h); powersgd_kernel.cpp picks the one matching
// ATen's CPU capability. Raw row-major float32 matrices, checked there.
#include <cstdint>

namespace ddpx::kernels::powersgd {

struct Matrices {
  int64_t rows = 0, cols = 0, r = 0;
  float* e = nullptr;              // M [rows, cols] (project: e, M built into it)
  const float* x = nullptr;        // project: the input added to e; null: none
  float* p = nullptr;              // P [rows, r]
  float* qt = nullptr;             // project: the warm Q^T; back_project: out;
                                   // expand: this rank's Q^T [r, cols]
  const float* qt_mean = nullptr;  // expand: the mean Q^T
  float* out = nullptr;            // expand: the result [rows, cols]
};

struct CpuPasses {
  void (*project)(const Matrices&) = nullptr;
  void (*back_project)(const Matrices&) = nullptr;
  void (*expand)(const Matrices&) = nullptr;  // e null: no residual update
};

CpuPasses cpu_passes_default();
CpuPasses cpu_passes_avx2();

}  // namespace ddpx::kernels::powersgd
