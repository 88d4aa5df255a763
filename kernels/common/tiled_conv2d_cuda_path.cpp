#include "kernels/common/tiled_conv2d_cuda_path.h"

#include <torch/library.h>

#include <cstring>

namespace ddpx::detail::cuda {
namespace {

bool auto_rule_aten(const Conv2dShape& s, Pass pass) {
  const bool single_filter = s.groups == 1 && s.c_in.expect_int() == 1 &&
                             s.c_out.expect_int() <= 2;
  if (!single_filter) return true;
  if (pass == Pass::kForward) return false;
  return s.kh.expect_int() * s.kw.expect_int() < 25;
}

}  // namespace

bool aten_serves(const Conv2dShape& s, at::ScalarType dtype, Pass pass) {
  (void)dtype;  // (one rule for every dtype until others are measured)
  const std::string want = conv_path_override();
  if (want == "auto") return auto_rule_aten(s, pass);
  return want == "aten";  // (tiled, direct, gemm: our kernels, which pick their own)
}

std::string conv_paths_name(const Conv2dShape& s, at::ScalarType dtype) {
  const char* fwd = aten_serves(s, dtype, Pass::kForward) ? "aten" : "tiled";
  const char* bwd = aten_serves(s, dtype, Pass::kBackward) ? "aten" : "tiled";
  if (std::strcmp(fwd, bwd) == 0) return fwd;
  return std::string(fwd) + "/" + bwd;
}

namespace {

std::string tiled_conv2d_path_cuda(const at::Tensor& input, const at::Tensor& weight,
                                   at::IntArrayRef stride, at::IntArrayRef padding,
                                   at::IntArrayRef dilation, int64_t groups) {
  const Conv2dShape s =
      check_tiled_conv2d_args(input, weight, std::nullopt, stride, padding, dilation, groups);
  return conv_paths_name(s, input.scalar_type());
}

}  // namespace

// (Registered from libddpx.so: the rule needs no CUDA headers, and the path
// a CUDA call takes can be asked where libddpx_cuda.so is absent too.)
TORCH_LIBRARY_IMPL(ddpx, CUDA, m) { m.impl("tiled_conv2d_path", TORCH_FN(tiled_conv2d_path_cuda)); }

}  // namespace ddpx::detail::cuda
