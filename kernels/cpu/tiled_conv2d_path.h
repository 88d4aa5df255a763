#pragma once
// Which CPU algorithm serves a ddpx::tiled_conv2d problem, decided per shape
// (as cuDNN's and ATen's own heuristics do) so that the op is never slower
// than ATen's convolution on the shapes users train:
//
//  direct  the seed's vectorised plane-by-filter loops (tiled_conv2d_vec.cpp)
//  gemm    our implicit GEMM over L2-sized im2col panels (tiled_conv2d_cpu.h)
//  aten    at::convolution / at::convolution_backward (oneDNN, or ATen's
//          depthwise and slow-conv kernels where oneDNN does not apply)
//
// Measured (issue 26) on this project's 2-core AVX-512 machine, torch's
// oneDNN, float32, stride 1, "same" padding, torch.set_num_threads(2); ratio =
// that path's time / F.conv2d's, forward; forward+backward, timed interleaved
// with F.conv2d (scripts/bench/conv2d). Single figures come from the one run
// on a quiet machine (13:33 UTC, after this direct-loop changes);
// ranges span runs while another engineer's build and tests shared the two
// cores. Those runs are not comparable: OpenMP's 2-thread regions then stall
// for scheduler ticks (F.conv2d of LeNet conv1 at batch 1 took 16 ms instead
// of 0.2 ms), which hurt oneDNN's many regions more than our few and made the
// direct loops look faster than they are. Re-measure on a quiet machine with
// scripts/bench/conv2d --path direct|gemm|aten before changing the rule.
//
//   case (N x Cin x H=W -> Cout, k, groups)  direct                gemm              chosen
//   seed 1x1x512..2048 -> 1, k3/k5           0.05-0.21; 0.03-0.07  -                 direct
//   lenet conv1 1x1x28 -> 6, k5              0.43; 0.39            0.5-0.7; 0.4-0.8  direct
//   lenet conv1 64x1x28 -> 6, k5             1.33; 0.90            1.4-2.2; 0.3-0.8  aten/direct
//   lenet conv2 1x6x14 -> 16, k5             1.2-1.3; 1.2-1.5      0.95; 0.79        gemm
//   lenet conv2 64x6x14 -> 16, k5            5-8; 4-11             2.3-3.9; 1.9-3.3  aten
//   depthwise 8x32..64x56, k3 g=C            1.34-1.39; 1.56-1.62  0.3-1.8; 0.3-1.4  aten
//   depthwise 8x32x56, k5 g32                0.4-2.3; 0.2-0.4      1.2-7; 0.4-1.0    aten/direct
//   resnet 8x64x56 .. 32x256x14, k3          5-28; 5-28            0.8-1.7; 0.9-1.6  aten
//
// The aten path costs what ATen's own op does: where both passes are ATen's,
// the Autograd kernel calls at::convolution with autograd on (ATen's backward
// node, no Function of ours), and inference skips our Function altogether.
// From TorchScript (ddpx-train, C++ programs) the forward then matches
// F.conv2d (ts_fwd_ratio 1.00-1.01 on LeNet conv2 b64 and ResNet); from
// Python, torch.ops' call adds ~10 us over F.conv2d's native binding (ours
// 254.6 us, torch.ops.aten.conv2d 251.2 us, F.conv2d 241.1 us on LeNet conv2
// b64, no_grad, medians of 400): a fixed cost that only our own kernels can
// win back, so small calls stay on them.
//
// Re-measured on a warm heap (benchlib.steady_heap; before it, page faults
// of fresh mmap'd tensors made oneDNN's 3x3 depthwise look 3-4x slower from
// ~3.6M multiply-adds on, a cliff that was the allocator's): direct for both
// passes of 3x3 depthwise is 1.3-1.5x F.conv2d at 1.8M multiply-adds and
// 1.7-4.9x from 3.6M (c32..c512, 7x7..112x112), so the rule below stands.
//
// So the rule (auto_rule in tiled_conv2d_path.cpp), for float32:
//  * one input channel per group (single-channel images, LeNet's first layer,
//    depthwise): forward direct for a single filter per image (<= 2 output
//    channels) or a small call (<= 1M multiply-adds), else aten; backward
//    direct, except 3x3 (or smaller) depthwise beyond 1M multiply-adds, where
//    oneDNN's depthwise kernel wins, and channels_last depthwise beyond 1M,
//    where oneDNN works in NHWC and ours on NCHW copies (7x7 c96 1.81x, 5x5
//    stride-2 c144 4.41x of F.conv2d forward+backward).
//  * several input channels per group: gemm for a small call (<= 1M
//    multiply-adds: oneDNN's per-call cost dominates), else aten. Our implicit
//    GEMM lost to oneDNN's blocked layouts at every larger size we measured.
//  float64 never reaches oneDNN (ATen's slow im2col path serves it): there the
//  seed's rule stays (direct for <= 4 input channels per group, else gemm).
//
// DDPX_CONV_PATH=auto|benchmark|tiled|direct|gemm|aten overrides the choice
// (read on every call, so tests can switch it): `tiled` is the seed's own rule
// (direct for <= 4 input channels per group, else gemm), `benchmark` measures
// the three paths per problem (kernels/common/conv_path_tuner.h), the others
// force one path.
#include <string>

#include "kernels/common/conv_path_tuner.h"
#include "kernels/cpu/tiled_conv2d_cpu.h"

namespace ddpx::detail::cpu {

// kMeasure: benchmark mode, and this pass of this problem not measured yet;
// the kernel measures the three real paths (conv_tune) and serves the call
// with the winner.
enum class ConvPath { kDirect, kGemm, kAten, kMeasure };
enum class ConvPass { kForward, kBackward };

// The paths benchmark mode measures, in the order of conv_tune's indices.
inline constexpr ConvPath kMeasuredPaths[] = {ConvPath::kDirect, ConvPath::kGemm,
                                              ConvPath::kAten};
inline constexpr int kMeasuredPathCount = 3;

const char* conv_path_name(ConvPath path);

// The path that serves one pass of problem `s` (of dtype `dtype`, on the
// CPU). The passes may differ: each reads only its own arguments (input,
// weight, grad_output), never a layout the other left behind.
ConvPath choose_conv_path(const Conv2dShape& s, at::ScalarType dtype, ConvPass pass);

// The key under which benchmark mode keeps that pass's choice.
ConvTuneKey cpu_tune_key(const Conv2dShape& s, at::ScalarType dtype, ConvPass pass);

// Whether ATen serves `pass` of problem `s` on the CPU (known to: a pass
// still to be measured answers no). ddpx::tiled_conv2d's Autograd kernel then
// calls at::convolution itself, with autograd on, so ATen records its own
// backward node (see ops/autograd/tiled_conv2d_kernel.cpp).
bool aten_serves(const Conv2dShape& s, at::ScalarType dtype, ConvPass pass);

// What ddpx::tiled_conv2d_path reports: "direct", or "<forward>/<backward>"
// ("aten/direct") when the passes differ; "measure" for a pass that
// benchmark mode has not measured yet.
std::string conv_paths_name(const Conv2dShape& s, at::ScalarType dtype);

}  // namespace ddpx::detail::cpu
