#pragma once
// Vectorized CPU gate step, compiled once per instruction set: the including
// file defines CPU_CAPABILITY (and CPU_CAPABILITY_AVX2/AVX512 with matching
// -m flags) exactly as ATen's own kernels do, and DDPX_GRU_GATES_FN, the name
// of the function returning this build's GruCpuGates. Keep this translation
// unit free of anything but the vector math: its inline code is compiled for
// the wider instruction set.
#include <ATen/cpu/vec/vec.h>

#include <algorithm>

#include "kernels/cpu/fused_gru_gates.h"

namespace ddpx::detail {
namespace {

template <typename T>
struct VecMath {
  using Vec = at::vec::Vectorized<T>;
  static Vec sigmoid(Vec x) { return Vec(T(1)) / (Vec(T(1)) + x.neg().exp()); }
  static Vec tanh(Vec x) { return x.tanh(); }
};

// Loads/stores `n` lanes; the tail of a row (n < Vec::size()) zero-fills.
template <typename T>
at::vec::Vectorized<T> load(const T* p, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  return n == Vec::size() ? Vec::loadu(p) : Vec::loadu(p, n);
}
template <typename T>
void store(const at::vec::Vectorized<T>& v, T* p, int64_t n) {
  if (n == at::vec::Vectorized<T>::size()) {
    v.store(p);
  } else {
    v.store(p, n);
  }
}

template <typename T>
void forward_step(const GruForwardStep<T>& p) {
  using Vec = at::vec::Vectorized<T>;
  const int64_t H = p.hidden;
  for (int64_t b = 0; b < p.batch; ++b) {
    const T* x = p.x_proj + b * p.x_proj_stride;                // [3*hidden]
    const T* hp = p.h_proj + b * p.h_proj_stride;               // [3*hidden]
    const T* h = p.h_prev + b * p.h_prev_stride;                // [hidden]
    T* h_out = p.h_out + b * p.h_out_stride;                    // [hidden]
    T* s = p.gates != nullptr ? p.gates + b * 4 * H : nullptr;  // [4*hidden]
    for (int64_t j = 0; j < H; j += Vec::size()) {
      const int64_t n = std::min<int64_t>(Vec::size(), H - j);
      Vec hr = load(hp + j, n), hz = load(hp + H + j, n), hn = load(hp + 2 * H + j, n);
      if (p.b_hh != nullptr) {
        hr = hr + load(p.b_hh + j, n);
        hz = hz + load(p.b_hh + H + j, n);
        hn = hn + load(p.b_hh + 2 * H + j, n);
      }
      Vec xr = load(x + j, n), xz = load(x + H + j, n), xn = load(x + 2 * H + j, n);
      if (p.b_ih != nullptr) {
        xr = xr + load(p.b_ih + j, n);
        xz = xz + load(p.b_ih + H + j, n);
        xn = xn + load(p.b_ih + 2 * H + j, n);
      }
      GruGates<Vec> g;
      const Vec h_new =
          gru_cell_forward<Vec, VecMath<T>>(xr, xz, xn, hr, hz, hn, load(h + j, n), g);
      store(h_new, h_out + j, n);
      if (s != nullptr) {
        store(g.r, s + j, n);
        store(g.z, s + H + j, n);
        store(g.n, s + 2 * H + j, n);
        store(g.hn, s + 3 * H + j, n);
      }
    }
  }
}

template <typename T>
void backward_step(const GruBackwardStep<T>& p) {
  using Vec = at::vec::Vectorized<T>;
  const int64_t H = p.hidden;
  for (int64_t b = 0; b < p.batch; ++b) {
    const T* go = p.grad_out + b * p.grad_out_stride;  // [hidden]
    T* dh = p.dh + b * H;                              // [hidden]
    const T* s = p.gates + b * 4 * H;                  // [4*hidden]
    const T* h = p.h_prev + b * p.h_prev_stride;       // [hidden]
    T* dx = p.dx_proj + b * 3 * H;                     // [3*hidden]
    T* dhp = p.dh_proj + b * 3 * H;                    // [3*hidden]
    T* bg = p.bias_grad;                               // [4*hidden], summed over rows
    for (int64_t j = 0; j < H; j += Vec::size()) {
      const int64_t n = std::min<int64_t>(Vec::size(), H - j);
      const GruGates<Vec> g{load(s + j, n), load(s + H + j, n), load(s + 2 * H + j, n),
                            load(s + 3 * H + j, n)};
      const GruGateGrads<Vec> d =
          gru_cell_backward<Vec>(load(dh + j, n) + load(go + j, n), g, load(h + j, n));
      store(d.dxr, dx + j, n);
      store(d.dxz, dx + H + j, n);
      store(d.dxn, dx + 2 * H + j, n);
      store(d.dxr, dhp + j, n);
      store(d.dxz, dhp + H + j, n);
      store(d.dhn, dhp + 2 * H + j, n);
      store(d.dh_direct, dh + j, n);
      if (bg != nullptr) {
        const bool first = b == 0;
        store(first ? d.dxr : load(bg + j, n) + d.dxr, bg + j, n);
        store(first ? d.dxz : load(bg + H + j, n) + d.dxz, bg + H + j, n);
        store(first ? d.dxn : load(bg + 2 * H + j, n) + d.dxn, bg + 2 * H + j, n);
        store(first ? d.dhn : load(bg + 3 * H + j, n) + d.dhn, bg + 3 * H + j, n);
      }
    }
  }
  if (p.bias_grad != nullptr && p.batch == 0) std::fill(p.bias_grad, p.bias_grad + 4 * H, T(0));
}

}  // namespace

GruCpuGates DDPX_GRU_GATES_FN() {
  GruCpuGates k;
  k.forward_f32 = &forward_step<float>;
  k.forward_f64 = &forward_step<double>;
  k.backward_f32 = &backward_step<float>;
  k.backward_f64 = &backward_step<double>;
  return k;
}

}  // namespace ddpx::detail
