// The CPU path choice of ddpx::tiled_conv2d (the measured table is in
// tiled_conv2d_path.h) and the CPU kernel of ddpx::tiled_conv2d_path, which
// tells a caller (the benchmark, a test, a user profiling a model) which path
// a problem takes.
#include "kernels/cpu/tiled_conv2d_path.h"

#include <torch/library.h>

#include <string>

namespace ddpx::detail::cpu {
namespace {

ConvPath seed_rule(const CpuConv& p) {
  // Direct loops win while each output sums over few input channels: the GEMM
  // path's panel gather costs as much as the arithmetic there.
  return p.cig <= 4 ? ConvPath::kDirect : ConvPath::kGemm;
}

// Multiply-adds of a convolution below which oneDNN's fixed cost per call
// (primitive lookup, layout reorders; ~50-100 us measured) outweighs its
// faster inner loops, so ours win (LeNet conv1 at batch 1: 0.12M, conv2 at
// batch 1: 0.47M).
constexpr int64_t kSmallMacs = 1 << 20;

ConvPath auto_rule(const CpuConv& p, at::MemoryFormat layout, at::ScalarType dtype,
                   ConvPass pass) {
  // float64 never reaches oneDNN (ATen runs its slow im2col + GEMM there), so
  // ours compete with a weaker peer: keep the seed's rule for it.
  if (dtype != at::kFloat) return seed_rule(p);
  const int64_t macs = p.n * p.cout * p.oh * p.ow * p.kc;
  if (p.cig > 1) return macs <= kSmallMacs ? ConvPath::kGemm : ConvPath::kAten;
  // One input channel per group: single-channel images, LeNet's first layer,
  // depthwise. Each output plane is one plane-by-filter correlation, which
  // the direct loops do at memory speed. Where oneDNN still wins on a quiet
  // machine: its register blocking over output channels in the forward of
  // larger calls (LeNet conv1 at batch 64: ours 1.33x), and its 3x3 depthwise
  // kernels in both passes (ours 1.3-1.6x). ATen's backward is slow for every
  // other shape here (2-4x ours: LeNet conv1, 5x5 depthwise).
  const bool small = macs <= kSmallMacs;
  if (pass == ConvPass::kBackward) {
    const bool depthwise_3x3 = p.groups > 1 && p.kh * p.kw <= 9;
    // channels_last depthwise: oneDNN's backward works in NHWC, ours on NCHW
    // copies of input and gradients (ours / F.conv2d forward+backward: 7x7
    // c96 56x56 1.81, 5x5 stride-2 c144 4.41; NCHW 7x7 c96 0.57).
    const bool depthwise_nhwc = p.groups > 1 && layout == at::MemoryFormat::ChannelsLast;
    return (depthwise_3x3 || depthwise_nhwc) && !small ? ConvPath::kAten : ConvPath::kDirect;
  }
  // oneDNN pads the one channel to its 16-channel blocks: on a single filter
  // over large images (the seed's) that multiplies its traffic.
  const bool single_image_filter = p.groups == 1 && p.cout <= 2;
  return single_image_filter || small ? ConvPath::kDirect : ConvPath::kAten;
}

}  // namespace

const char* conv_path_name(ConvPath path) {
  switch (path) {
    case ConvPath::kDirect:
      return "direct";
    case ConvPath::kGemm:
      return "gemm";
    case ConvPath::kAten:
      return "aten";
    case ConvPath::kMeasure:
      return "measure";
  }
  return "?";
}

ConvTuneKey cpu_tune_key(const Conv2dShape& s, at::ScalarType dtype, ConvPass pass) {
  return conv_tune_key(s, c10::Device(c10::kCPU), dtype, pass == ConvPass::kForward ? 0 : 1);
}

// The choice DDPX_CONV_PATH asks for.
static ConvPath choose_by_override(const Conv2dShape& s, at::ScalarType dtype, ConvPass pass) {
  const std::string want = conv_path_override();
  if (want == "auto") return auto_rule(make_cpu_conv(s), s.layout, dtype, pass);
  if (want == "benchmark") {
    const auto got = conv_tuned_choice(cpu_tune_key(s, dtype, pass));
    return got ? kMeasuredPaths[*got] : ConvPath::kMeasure;
  }
  if (want == "tiled") return seed_rule(make_cpu_conv(s));
  if (want == "direct") return ConvPath::kDirect;
  if (want == "gemm") return ConvPath::kGemm;
  return ConvPath::kAten;
}

ConvPath choose_conv_path(const Conv2dShape& s, at::ScalarType dtype, ConvPass pass) {
  const ConvPath p = choose_by_override(s, dtype, pass);
  if (aten_computes(s) || (p != ConvPath::kAten && p != ConvPath::kMeasure)) return p;
  return seed_rule(make_cpu_conv(s));  // not ATen's, whatever was asked (tiled_conv2d_args.h)
}

bool aten_serves(const Conv2dShape& s, at::ScalarType dtype, ConvPass pass) {
  return choose_conv_path(s, dtype, pass) == ConvPath::kAten;
}

std::string conv_paths_name(const Conv2dShape& s, at::ScalarType dtype) {
  const ConvPath fwd = choose_conv_path(s, dtype, ConvPass::kForward);
  const ConvPath bwd = choose_conv_path(s, dtype, ConvPass::kBackward);
  if (fwd == bwd) return conv_path_name(fwd);
  return std::string(conv_path_name(fwd)) + "/" + conv_path_name(bwd);
}

namespace {

std::string tiled_conv2d_path_cpu(const at::Tensor& input, const at::Tensor& weight,
                                  at::IntArrayRef stride, at::IntArrayRef padding,
                                  at::IntArrayRef dilation, int64_t groups) {
  const Conv2dShape s =
      check_tiled_conv2d_args(input, weight, std::nullopt, stride, padding, dilation, groups);
  return conv_paths_name(s, input.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpx, CPU, m) { m.impl("tiled_conv2d_path", TORCH_FN(tiled_conv2d_path_cpu)); }

}  // namespace ddpx::detail::cpu
