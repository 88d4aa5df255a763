#pragma once
// GRU gate math for one element of one time step, forward and backward, written
// once for the CPU kernels (scalar and at::vec::Vectorized lanes), the CUDA
// kernel and the C++ tests. Same formulas and gate order as torch.nn.GRU:
//
//   r  = sigmoid(x_r + h_r)            x_* = (W_ih x + b_ih) rows r, z, n
//   z  = sigmoid(x_z + h_z)            h_* = (W_hh h + b_hh) rows r, z, n
//   n  = tanh(x_n + r * h_n)
//   h' = n + z * (h - n)               (= (1 - z) n + z h, ATen's rounding)
//
// Forward keeps (r, z, n, h_n) per element: everything backward needs besides
// h, which the layer output already holds.
#include <cmath>
#include <cstdint>

#include "kernels/common/host_device.h"

namespace ddpx::detail {

// sigmoid/tanh for plain float and double, on host and device. The CPU kernels
// pass their own Math with the same two functions over vector lanes.
struct GruScalarMath {
  static DDPX_HD float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
  static DDPX_HD double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
  static DDPX_HD float tanh(float x) { return tanhf(x); }
  static DDPX_HD double tanh(double x) { return ::tanh(x); }
};

// Gate values of one element, in the order they are saved for backward.
template <typename T>
struct GruGates {
  T r, z, n, hn;  // hn = (W_hn h + b_hn), before the reset gate scales it
};

// Forward of one element: x_* from the input projection, h_* from the hidden
// projection (biases included), h the previous hidden state. Returns h'.
template <typename T, typename Math = GruScalarMath>
DDPX_HD T gru_cell_forward(T xr, T xz, T xn, T hr, T hz, T hn, T h, GruGates<T>& g) {
  g.r = Math::sigmoid(xr + hr);
  g.z = Math::sigmoid(xz + hz);
  g.n = Math::tanh(xn + g.r * hn);
  g.hn = hn;
  return g.n + g.z * (h - g.n);
}

// Gradients of one element with respect to the pre-activations: the input
// projection rows (dx_*) and the hidden projection rows (dh_*). Only the n row
// differs: the hidden one is scaled by r.
template <typename T>
struct GruGateGrads {
  T dxr, dxz, dxn;  // = d(W_ih x + b_ih) rows r, z, n
  T dhn;            // = d(W_hn h + b_hn); rows r and z equal dxr and dxz
  T dh_direct;      // part of dL/dh through h' = n + z (h - n) directly: z dh'
};

// Backward of one element: dh_new = dL/dh' (from the layer output plus the next
// step), g and h as in forward.
template <typename T>
DDPX_HD GruGateGrads<T> gru_cell_backward(T dh_new, const GruGates<T>& g, T h) {
  const T one(1);
  const T dn = dh_new * (one - g.z);
  const T dz = dh_new * (h - g.n);
  GruGateGrads<T> d;
  d.dxn = dn * (one - g.n * g.n);  // tanh' = 1 - n^2
  d.dhn = d.dxn * g.r;
  d.dxr = d.dxn * g.hn * g.r * (one - g.r);  // sigmoid' = r (1 - r)
  d.dxz = dz * g.z * (one - g.z);
  d.dh_direct = dh_new * g.z;
  return d;
}

// ---- one time step over [batch, hidden] elements --------------------------------
//
// Pointers and strides of one step. Row strides are in elements; within a row
// the r, z, n blocks of a [.., 3*hidden] tensor are hidden elements apart and
// the saved gates of a [.., 4*hidden] row are r, z, n, hn. T is the storage
// type; `void` for the type-erased form the sequence driver passes around.
template <typename T>
struct GruForwardStep {
  int64_t batch = 0, hidden = 0;
  const T* x_proj = nullptr;  // [batch, 3*hidden] W_ih x_t, without bias
  int64_t x_proj_stride = 0;
  const T* h_proj = nullptr;  // [batch, 3*hidden] W_hh h_{t-1}, without bias
  int64_t h_proj_stride = 0;
  const T* b_hh = nullptr;    // [3*hidden] or nullptr (has_biases=false)
  const T* b_ih = nullptr;    // [3*hidden] or nullptr; added here, not by a GEMM
                              // epilogue over [seq*batch, 3*hidden]
  const T* h_prev = nullptr;  // [batch, hidden]
  int64_t h_prev_stride = 0;
  T* h_out = nullptr;  // [batch, hidden]
  int64_t h_out_stride = 0;
  T* gates = nullptr;  // [batch, 4*hidden] contiguous, or nullptr: nothing saved
};

template <typename T>
struct GruBackwardStep {
  int64_t batch = 0, hidden = 0;
  const T* grad_out = nullptr;  // [batch, hidden] dL/dh_t from the layer output
  int64_t grad_out_stride = 0;
  T* dh = nullptr;            // [batch, hidden] contiguous; in: dL/dh_t from step t+1,
                              // out: z dh', the direct part of dL/dh_{t-1}
  const T* gates = nullptr;   // [batch, 4*hidden] contiguous, saved by forward
  const T* h_prev = nullptr;  // [batch, hidden]
  int64_t h_prev_stride = 0;
  T* dx_proj = nullptr;  // [batch, 3*hidden] contiguous
  T* dh_proj = nullptr;  // [batch, 3*hidden] contiguous
  // [4*hidden] or nullptr. A kernel that sets GruStepKernels::sums_bias_grads
  // writes this step's sums over the batch rows of dx_r, dx_z, dx_n, dh_n:
  // the bias gradients without another pass over dx_proj and dh_proj.
  T* bias_grad = nullptr;
};

// Casts the type-erased step to the storage type.
template <typename T>
GruForwardStep<T> typed(const GruForwardStep<void>& p) {
  return {p.batch,
          p.hidden,
          static_cast<const T*>(p.x_proj),
          p.x_proj_stride,
          static_cast<const T*>(p.h_proj),
          p.h_proj_stride,
          static_cast<const T*>(p.b_hh),
          static_cast<const T*>(p.b_ih),
          static_cast<const T*>(p.h_prev),
          p.h_prev_stride,
          static_cast<T*>(p.h_out),
          p.h_out_stride,
          static_cast<T*>(p.gates)};
}

template <typename T>
GruBackwardStep<T> typed(const GruBackwardStep<void>& p) {
  return {p.batch,
          p.hidden,
          static_cast<const T*>(p.grad_out),
          p.grad_out_stride,
          static_cast<T*>(p.dh),
          static_cast<const T*>(p.gates),
          static_cast<const T*>(p.h_prev),
          p.h_prev_stride,
          static_cast<T*>(p.dx_proj),
          static_cast<T*>(p.dh_proj),
          static_cast<T*>(p.bias_grad)};
}

// The CUDA grid: one thread per element of the [batch, hidden] step, in
// row-major order, grid-stride so any grid covers any size.
struct GruElement {
  int64_t row, col;
};
DDPX_HD GruElement gru_element(int64_t flat, int64_t hidden) {
  return {flat / hidden, flat % hidden};
}
DDPX_HD int64_t gru_grid_blocks(int64_t elements, int64_t threads, int64_t max_blocks) {
  const int64_t blocks = (elements + threads - 1) / threads;
  return blocks < max_blocks ? (blocks > 0 ? blocks : 1) : max_blocks;
}

// One element of a forward step, computing in Acc (float for half/bfloat16).
template <typename T, typename Acc = T>
DDPX_HD void gru_step_forward_element(const GruForwardStep<T>& p, int64_t row, int64_t col) {
  const int64_t H = p.hidden;
  const T* x = p.x_proj + row * p.x_proj_stride + col;
  const T* hp = p.h_proj + row * p.h_proj_stride + col;
  Acc hr = static_cast<Acc>(hp[0]), hz = static_cast<Acc>(hp[H]), hn = static_cast<Acc>(hp[2 * H]);
  if (p.b_hh != nullptr) {
    hr += static_cast<Acc>(p.b_hh[col]);
    hz += static_cast<Acc>(p.b_hh[H + col]);
    hn += static_cast<Acc>(p.b_hh[2 * H + col]);
  }
  Acc xr = static_cast<Acc>(x[0]), xz = static_cast<Acc>(x[H]), xn = static_cast<Acc>(x[2 * H]);
  if (p.b_ih != nullptr) {
    xr += static_cast<Acc>(p.b_ih[col]);
    xz += static_cast<Acc>(p.b_ih[H + col]);
    xn += static_cast<Acc>(p.b_ih[2 * H + col]);
  }
  GruGates<Acc> g;
  const Acc h = gru_cell_forward<Acc>(xr, xz, xn, hr, hz, hn,
                                      static_cast<Acc>(p.h_prev[row * p.h_prev_stride + col]), g);
  p.h_out[row * p.h_out_stride + col] = static_cast<T>(h);
  if (p.gates != nullptr) {
    T* s = p.gates + row * 4 * H + col;
    s[0] = static_cast<T>(g.r);
    s[H] = static_cast<T>(g.z);
    s[2 * H] = static_cast<T>(g.n);
    s[3 * H] = static_cast<T>(g.hn);
  }
}

// One element of a backward step.
template <typename T, typename Acc = T>
DDPX_HD void gru_step_backward_element(const GruBackwardStep<T>& p, int64_t row, int64_t col) {
  const int64_t H = p.hidden;
  const T* s = p.gates + row * 4 * H + col;
  const GruGates<Acc> g{static_cast<Acc>(s[0]), static_cast<Acc>(s[H]), static_cast<Acc>(s[2 * H]),
                        static_cast<Acc>(s[3 * H])};
  T* dh = p.dh + row * H + col;
  const Acc dh_new =
      static_cast<Acc>(*dh) + static_cast<Acc>(p.grad_out[row * p.grad_out_stride + col]);
  const GruGateGrads<Acc> d =
      gru_cell_backward<Acc>(dh_new, g, static_cast<Acc>(p.h_prev[row * p.h_prev_stride + col]));
  T* dx = p.dx_proj + row * 3 * H + col;
  T* dhp = p.dh_proj + row * 3 * H + col;
  dx[0] = dhp[0] = static_cast<T>(d.dxr);
  dx[H] = dhp[H] = static_cast<T>(d.dxz);
  dx[2 * H] = static_cast<T>(d.dxn);
  dhp[2 * H] = static_cast<T>(d.dhn);
  *dh = static_cast<T>(d.dh_direct);
}

}  // namespace ddpx::detail
