#pragma once
// Which implementation serves a ddpx::tiled_conv2d pass on CUDA: our kernels
// (kernels/cuda/tiled_conv2d_kernel.cu, `tiled`) or cuDNN through
// at::convolution / at::convolution_backward (`aten`), per shape, so that
// the op is not slower than F.conv2d where cuDNN wins (the CPU's rule is
// kernels/cpu/tiled_conv2d_path.h). C++ only: libddpx.so decides, the CUDA
// kernels and the Autograd kernel ask.
//
// Measured on a lent H100 (bench_results/gpu/2026-11-27-h100/conv2d-cuda.json:
// torch 2.11 + cuDNN 9, float32, stride 1, "same" padding; cuDNN with torch's
// defaults, TF32 allowed), ours / F.conv2d, forward; backward (the difference
// of the forward+backward and forward times), device events around
// back-to-back calls:
//
//   case (N x Cin x H=W -> Cout, k, groups)   forward     backward
//   seed 1x1x512..2048 -> 1, k3               0.28-0.99   3.6-28      (cuDNN's 3x3 grad kernels)
//   seed 1x1x512..2048 -> 1, k5               0.09-0.19   0.55-0.64
//   lenet conv1 1x1x28 -> 6, k5 (b1, b64)     0.94, 0.95  1.15, 1.02
//   lenet conv2 1x6x14 -> 16, k5 (b1, b64)    0.92, 1.31  0.80, 1.04
//   depthwise 8x32..64x56, k3/k5 g=C          1.6-2.4     1.3-2.1
//   resnet 8x64x56 .. 32x256x14, k3           8-23        13-99
//
// (Our kernels then: the general direct path, one thread per output with
// run-time loops, and a weight gradient of one block per tap.) The
// small-filter kernels that replaced them (conv_small_kernel.cu: 3x3/5x5/7x7
// at stride 1 and 2, channels_last depthwise in NHWC, the weight gradient as
// partial sums on the forward's blocks) first ran on a lent H200
// (bench_results/gpu/2026-11-30-h200/: conv2d-cuda.json, eager calls, and
// resume/conv2d-cuda-graphs.json, the kernels alone in CUDA graphs), ours /
// cuDNN or ATen's own kernel, forward + backward (eager; graphs):
//
//   seed 1x1x512..2048 -> 1, k3               0.29-0.52; 0.16-0.35  (backward 0.20-0.54)
//   seed 1x1x512..2048 -> 1, k5               0.01-0.19 either way
//   lenet conv1 1..64x1x28 -> 6, k5           forward 0.52-0.54, backward 1.01-1.03
//   lenet conv2 1..64x6x14 -> 16, k5          0.78, 1.84
//   depthwise k3 stride 1 (NCHW, cl)          1.25-1.43 (ATen: 0.98-1.69)
//   depthwise k3 stride 2 NCHW                0.84; 1.43 (ATen: 1.0; 1.76)
//   depthwise k3 stride 2 channels_last       1.01 (ATen: 1.0)
//   depthwise k5 stride 1 NCHW                0.99; 1.39 (ATen: 1.09; 1.70)
//   depthwise k5 stride 2 channels_last       0.91 (ATen: 1.0)
//   depthwise k7 NCHW, channels_last          0.50, 0.86 (ATen: 1.0, 2.14: cuDNN's NHWC)
//   resnet 8x64x56 .. 32x256x14, k3           18-122
//
// (the depthwise peer: the better of ATen's own NCHW kernel and cuDNN on
// channels_last input, as PyTorch picks.) So the rule (auto), only where our
// small-filter kernels serve (square 3x3, 5x5 or 7x7 filters, stride 1 or 2
// both ways, dilation 1; elsewhere ours are the general kernels, 8-122x
// cuDNN): ours for the forward over single-channel images (groups 1, one
// input channel, up to 8 filters) and for their backward with one or two
// filters; for float32 depthwise convolution (one filter per channel) with
// 5x5 or 7x7 filters, and 3x3 at stride 2 in NCHW; cuDNN (ATen) for
// everything else, where no ratio of ours was below its peer's by more than
// the noise. NCHW depthwise only where the output planes fill at least half
// of our kernels' 32x32 tiles (tile::small_tile_fill): every plane measured
// filled 77% (56x56 outputs); at 14x14 (ConvNeXt's third stage) a block
// would idle 81% of its threads and at 7x7 95%, while ATen's kernel gives
// each output a thread. Not measured yet: the bench's "depthwise 7x7 c384
// 14" and "c768 7" cases time ours there (own_ratio). Other dtypes follow
// the float32 rule for single-channel images and take cuDNN for depthwise
// (unmeasured: cuDNN serves half precision depthwise itself).
// DDPX_CONV_PATH (read on every call): `aten` forces cuDNN, `tiled` (or the
// CPU's direct/gemm) forces ours, `auto` or unset is the rule, and
// `benchmark` (or `auto` with torch.backends.cudnn.benchmark set) measures
// both per problem (kernels/common/conv_path_tuner.h).
#include <ATen/ATen.h>

#include <string>

#include "kernels/common/conv_path_tuner.h"
#include "kernels/common/tiled_conv2d_args.h"

namespace ddpx::detail::cuda {

enum class Pass { kForward, kBackward };

// Who serves a pass: cuDNN, our kernels, or, in benchmark mode before this
// pass of this problem was measured, both in turn (the kernel measures them
// with conv_tune, candidates in the order kAten, kOurs).
enum class Choice { kAten = 0, kOurs = 1, kMeasure = 2 };

Choice choose(const Conv2dShape& s, c10::Device device, at::ScalarType dtype, Pass pass);

// The fixed rule's answer (what a call to be measured takes when it cannot
// be: under CUDA graph capture, where syncing is not allowed).
bool rule_aten(const Conv2dShape& s, at::ScalarType dtype, Pass pass);

ConvTuneKey cuda_tune_key(const Conv2dShape& s, c10::Device device, at::ScalarType dtype,
                          Pass pass);

// Whether cuDNN (ATen) is known to serve `pass` of problem `s` on CUDA (a
// pass still to be measured answers no).
bool aten_serves(const Conv2dShape& s, c10::Device device, at::ScalarType dtype, Pass pass);

// What ddpx::tiled_conv2d_path reports for a CUDA input: "tiled", "aten",
// "measure" (not measured yet), or "<forward>/<backward>" when the passes
// differ.
std::string conv_paths_name(const Conv2dShape& s, c10::Device device, at::ScalarType dtype);

}  // namespace ddpx::detail::cuda
