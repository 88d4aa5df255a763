#pragma once
// The three passes of a PowerSGD step over one matrix M [rows, cols] (see
// plugin/comm/codec_powersgd.cpp), with Q held transposed, Q^T [r, cols]:
//   project:      M = e + x (built in e, when x is given), P = M Q   [rows, r]
//   back_project: Q^T = P^T M                                        [r, cols]
//   expand:       out = P Qm^T; and, when e is given, e -= P Ql^T    [rows, cols]
// On the CPU these are our own loops (kernels/cpu/powersgd_kernel*, one
// build per instruction set): each element's sum runs in a fixed order set
// by its indices alone, not by the matrix's address, so a tensor packed at
// another offset of a bucket gives the same bits. They are also faster: the
// AVX2 build does the three passes over a 512 x 4608 matrix (rank 4, one
// thread) in 7.2 ms, ATen's five calls took 9.7 ms. Through ATen
// (MKL) it did not: M Q moved in the last place with M's 16-byte alignment,
// and with Q^T M^T, fresh outputs and copies before the QR the GradSync runs
// still differed between plans. Elsewhere (CUDA) they are ATen's mm/addmm
// (no bitwise promise across packings there). Every tensor is a row-major
// (contiguous) float32 matrix view; p and qt are written, not accumulated
// into.
#include <ATen/core/Tensor.h>

namespace ddpx::kernels::powersgd {

void project(const at::Tensor& e, const at::Tensor& x, const at::Tensor& qt, const at::Tensor& p);
void back_project(const at::Tensor& m, const at::Tensor& p, const at::Tensor& qt);
void expand(const at::Tensor& p, const at::Tensor& qt_mean, const at::Tensor& out,
            const at::Tensor& qt_local, const at::Tensor& e);

}  // namespace ddpx::kernels::powersgd
