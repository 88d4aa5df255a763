#pragma once
// The CPU fused gate step of ddpx::fused_gru, built once per instruction set
// (fused_gru_gates_{default,avx2,avx512}.cpp from fused_gru_gates_impl.h);
// fused_gru_kernel.cpp picks the one matching ATen's CPU capability.
#include "kernels/common/gru_cell.h"

namespace ddpx::detail {

struct GruCpuGates {
  void (*forward_f32)(const GruForwardStep<float>&) = nullptr;
  void (*forward_f64)(const GruForwardStep<double>&) = nullptr;
  void (*backward_f32)(const GruBackwardStep<float>&) = nullptr;
  void (*backward_f64)(const GruBackwardStep<double>&) = nullptr;
};

GruCpuGates gru_cpu_gates_default();
GruCpuGates gru_cpu_gates_avx2();
GruCpuGates gru_cpu_gates_avx512();

}  // namespace ddpx::detail
