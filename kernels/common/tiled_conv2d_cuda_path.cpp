#include "kernels/common/tiled_conv2d_cuda_path.h"

#include <torch/library.h>

#include <cstring>

#include "kernels/common/conv_tile_small.h"

namespace ddpx::detail::cuda {
namespace {

const char* choice_name(Choice c) {
  switch (c) {
    case Choice::kAten:
      return "aten";
    case Choice::kOurs:
      return "tiled";
    case Choice::kMeasure:
      return "measure";
  }
  return "?";
}

}  // namespace

// (the measurements and the reasons: tiled_conv2d_cuda_path.h)
bool rule_aten(const Conv2dShape& s, at::ScalarType dtype, Pass pass) {
  const tile::ConvGeom g = conv_geom(s);
  const tile::SmallFilter small = tile::small_filter(g);
  if (!small) return true;
  if (g.groups == 1 && g.c == 1) return g.cout > (pass == Pass::kForward ? 8 : 2);
  const bool depthwise = g.c > 1 && g.groups == g.c && g.cout == g.c;
  if (!depthwise || dtype != at::kFloat) return true;
  // (NCHW: every measured plane filled 77% of our tiles; on small planes
  // most of a block idles, where ATen's kernel has a thread per output.)
  if (s.layout == at::MemoryFormat::Contiguous && tile::small_tile_fill(g) < 0.5) return true;
  if (small.k >= 5) return false;
  return !(small.s == 2 && s.layout == at::MemoryFormat::Contiguous);
}

ConvTuneKey cuda_tune_key(const Conv2dShape& s, c10::Device device, at::ScalarType dtype,
                          Pass pass) {
  return conv_tune_key(s, device, dtype, pass == Pass::kForward ? 0 : 1);
}

namespace {

Choice choose_by_override(const Conv2dShape& s, c10::Device device, at::ScalarType dtype,
                          Pass pass) {
  // (one rule for every dtype until others are measured)
  const std::string want = conv_path_override();
  if (conv_benchmark_mode(c10::DeviceType::CUDA, want)) {
    const auto got = conv_tuned_choice(cuda_tune_key(s, device, dtype, pass));
    return got ? static_cast<Choice>(*got) : Choice::kMeasure;
  }
  if (want == "auto") return rule_aten(s, dtype, pass) ? Choice::kAten : Choice::kOurs;
  // (tiled, direct, gemm: our kernels, which pick their own)
  return want == "aten" ? Choice::kAten : Choice::kOurs;
}

}  // namespace

Choice choose(const Conv2dShape& s, c10::Device device, at::ScalarType dtype, Pass pass) {
  // Ours where ATen would not compute the convolution, whatever was asked
  // (tiled_conv2d_args.h).
  return aten_computes(s) ? choose_by_override(s, device, dtype, pass) : Choice::kOurs;
}

bool aten_serves(const Conv2dShape& s, c10::Device device, at::ScalarType dtype, Pass pass) {
  return choose(s, device, dtype, pass) == Choice::kAten;
}

std::string conv_paths_name(const Conv2dShape& s, c10::Device device, at::ScalarType dtype) {
  const char* fwd = choice_name(choose(s, device, dtype, Pass::kForward));
  const char* bwd = choice_name(choose(s, device, dtype, Pass::kBackward));
  if (std::strcmp(fwd, bwd) == 0) return fwd;
  return std::string(fwd) + "/" + bwd;
}

namespace {

std::string tiled_conv2d_path_cuda(const at::Tensor& input, const at::Tensor& weight,
                                   at::IntArrayRef stride, at::IntArrayRef padding,
                                   at::IntArrayRef dilation, int64_t groups) {
  const Conv2dShape s =
      check_tiled_conv2d_args(input, weight, std::nullopt, stride, padding, dilation, groups);
  return conv_paths_name(s, input.device(), input.scalar_type());
}

}  // namespace

// (Registered from libddpx.so: the rule needs no CUDA headers, and the path
// a CUDA call takes can be asked where libddpx_cuda.so is absent too.)
TORCH_LIBRARY_IMPL(ddpx, CUDA, m) { m.impl("tiled_conv2d_path", TORCH_FN(tiled_conv2d_path_cuda)); }

}  // namespace ddpx::detail::cuda
