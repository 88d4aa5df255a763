#pragma once
// Vectorised inner loops of the CPU direct path of ddpx::tiled_conv2d: one 2-D
// correlation between an input plane and one filter, on raw pointers.
//
// tiled_conv2d_vec.cpp is compiled once per CPU capability (DEFAULT, AVX2,
// AVX512: each object gets its own -m flags and at::vec namespace), and
// vec_kernels() picks the best one the running CPU has, as ATen's DispatchStub
// does. DDPX_CPU_CAPABILITY=default|avx2|avx512 forces a lower one (the tests
// use it to run the scalar build on an AVX-512 machine).
#include <cstdint>

namespace ddpx::detail::cpu {

// Geometry of one plane-by-filter correlation:
//   out[y, x] += sum_{i<kh, j<kw} taps[i*kw + j] * in[y*sh - ph + i*dh, x*sw - pw + j*dw]
// where taps outside the input plane contribute nothing (zero padding).
// ph/pw may be negative: the transposed convolution (grad_input) reuses this
// with padding (k-1)*d - p, which crops when p exceeds (k-1)*d.
struct PlaneGeom {
  int64_t h, w;    // input plane [h, w], row stride w
  int64_t oh, ow;  // output plane [oh, ow], row stride ow
  int64_t kh, kw;
  int64_t sh, sw, ph, pw, dh, dw;
};

template <typename T>
using CorrRowsFn = void (*)(const PlaneGeom& g, const T* in, const T* taps, T* out, int64_t y0,
                            int64_t y1);
// acc[i*kw + j] += sum_{y in [y0, y1), x} gout[y, x] * in[y*sh - ph + i*dh, x*sw - pw + j*dw]
template <typename T>
using WeightRowsFn = void (*)(const PlaneGeom& g, const T* in, const T* gout, double* acc,
                              int64_t y0, int64_t y1);

struct VecKernels {
  const char* name;  // "DEFAULT", "AVX2" or "AVX512"
  CorrRowsFn<float> corr_rows_f;
  CorrRowsFn<double> corr_rows_d;
  WeightRowsFn<float> weight_rows_f;
  WeightRowsFn<double> weight_rows_d;

  template <typename T>
  CorrRowsFn<T> corr_rows() const;
  template <typename T>
  WeightRowsFn<T> weight_rows() const;
};

template <>
inline CorrRowsFn<float> VecKernels::corr_rows<float>() const {
  return corr_rows_f;
}
template <>
inline CorrRowsFn<double> VecKernels::corr_rows<double>() const {
  return corr_rows_d;
}
template <>
inline WeightRowsFn<float> VecKernels::weight_rows<float>() const {
  return weight_rows_f;
}
template <>
inline WeightRowsFn<double> VecKernels::weight_rows<double>() const {
  return weight_rows_d;
}

// One table per compiled capability (defined in tiled_conv2d_vec.cpp).
const VecKernels* vec_kernels_DEFAULT();
const VecKernels* vec_kernels_AVX2();
const VecKernels* vec_kernels_AVX512();

// The best table for this CPU (decided once).
const VecKernels& vec_kernels();

}  // namespace ddpx::detail::cpu
