#pragma once
// Marks tile/index math that runs on the GPU and is driven by the CPU tests.
// Under nvcc it is __host__ __device__; under a plain C++ compiler it is inline.
#if defined(__CUDACC__)
#define DDPX_HD __host__ __device__ __forceinline__
#else
#define DDPX_HD inline
#endif
