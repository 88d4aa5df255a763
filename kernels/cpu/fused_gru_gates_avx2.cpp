// The AVX2 build of the CPU gate step. kernels/CMakeLists.txt adds the -m
// flags on x86-64; elsewhere this file hands back the scalar-lane build.
#if defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define DDPX_GRU_GATES_FN gru_cpu_gates_avx2
#include "kernels/cpu/fused_gru_gates_impl.h"
#else
#include "kernels/cpu/fused_gru_gates.h"
namespace ddpx::detail {
GruCpuGates gru_cpu_gates_avx2() { return gru_cpu_gates_default(); }
}  // namespace ddpx::detail
#endif
