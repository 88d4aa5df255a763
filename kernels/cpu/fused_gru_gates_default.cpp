// The scalar-lane build of the CPU gate step: every CPU runs it.
#define CPU_CAPABILITY DEFAULT
#define DDPX_GRU_GATES_FN gru_cpu_gates_default
#include "kernels/cpu/fused_gru_gates_impl.h"
