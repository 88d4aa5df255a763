// The baseline build of PowerSGD's CPU passes: every x86-64 CPU runs it.
#define DDPX_POWERSGD_FN cpu_passes_default
#include "kernels/cpu/powersgd_kernel_impl.h"
