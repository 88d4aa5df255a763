// The AVX2 + FMA build of PowerSGD's CPU passes. kernels/CMakeLists.txt adds
// the -m flags on x86-64; elsewhere this file hands back the baseline build.
#if defined(__AVX2__) && defined(__FMA__)
#define DDPX_POWERSGD_FN cpu_passes_avx2
#include "kernels/cpu/powersgd_kernel_impl.h"
#else
#include "kernels/cpu/powersgd_kernel.h"
namespace ddpx::kernels::powersgd {
CpuPasses cpu_passes_avx2() { return cpu_passes_default(); }
}  // namespace ddpx::kernels::powersgd
#endif
