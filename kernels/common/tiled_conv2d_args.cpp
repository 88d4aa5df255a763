#include "kernels/common/tiled_conv2d_args.h"

#include <c10/core/SymBool.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <optional>
#include <string>

namespace ddpx::detail {

namespace {

std::array<int64_t, 2> pair_arg(at::IntArrayRef v, const char* name) {
  TORCH_CHECK(v.size() == 2, name, " must have 2 elements (vertical, horizontal), got ", v.size());
  return {v[0], v[1]};
}

}  // namespace

bool aten_computes(const Conv2dShape& s) {
  const auto zero = [](const c10::SymInt& v) {
    return v.maybe_as_int() == std::optional<int64_t>(0);
  };
  return !zero(s.c_in) && !zero(s.h) && !zero(s.w);
}

bool tiled_conv2d_dtype_supported(c10::DeviceType device_type, at::ScalarType dtype) {
  if (dtype == at::kFloat || dtype == at::kDouble) return true;
  // Half precision only where the hardware computes it (CUDA), and only the
  // CUDA build registers a CUDA kernel at all.
  return device_type == c10::DeviceType::CUDA && (dtype == at::kHalf || dtype == at::kBFloat16);
}

Conv2dShape check_tiled_conv2d_args(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                    at::IntArrayRef padding, at::IntArrayRef dilation,
                                    int64_t groups) {
  TORCH_CHECK(input.defined(), "input must be a defined tensor");
  TORCH_CHECK(weight.defined(), "weight must be a defined tensor");
  TORCH_CHECK(input.layout() == at::kStrided, "input must be a strided (dense) tensor, got ",
              input.layout());
  TORCH_CHECK(weight.layout() == at::kStrided, "weight must be a strided (dense) tensor, got ",
              weight.layout());
  TORCH_CHECK(input.dim() == 3 || input.dim() == 4,
              "input must be 3-D [in_channels, H, W] (unbatched) or 4-D [batch, in_channels, H, "
              "W], got ",
              input.dim(), "-D");
  TORCH_CHECK(weight.dim() == 4,
              "weight must be 4-D [out_channels, in_channels/groups, kH, kW], got ", weight.dim(),
              "-D");
  TORCH_CHECK(weight.device() == input.device(), "weight must be on the same device as input (",
              input.device(), "), got ", weight.device());
  TORCH_CHECK(weight.scalar_type() == input.scalar_type(),
              "weight must have the same dtype as input (", input.scalar_type(), "), got ",
              weight.scalar_type());
  TORCH_CHECK(tiled_conv2d_dtype_supported(input.device().type(), input.scalar_type()),
              "input dtype ", input.scalar_type(), " is not supported on ", input.device().type(),
              " (float32/float64; float16/bfloat16 on CUDA)");

  Conv2dShape s;
  s.stride = pair_arg(stride, "stride");
  s.padding = pair_arg(padding, "padding");
  s.dilation = pair_arg(dilation, "dilation");
  s.groups = groups;
  TORCH_CHECK(s.stride[0] > 0 && s.stride[1] > 0, "stride must be positive, got (", s.stride[0],
              ", ", s.stride[1], ")");
  TORCH_CHECK(s.padding[0] >= 0 && s.padding[1] >= 0, "padding must be non-negative, got (",
              s.padding[0], ", ", s.padding[1], ")");
  TORCH_CHECK(s.dilation[0] > 0 && s.dilation[1] > 0, "dilation must be positive, got (",
              s.dilation[0], ", ", s.dilation[1], ")");
  TORCH_CHECK(groups > 0, "groups must be positive, got ", groups);

  s.unbatched = input.dim() == 3;
  const auto in = input.sym_sizes();
  const int64_t off = s.unbatched ? 1 : 0;
  s.n = s.unbatched ? c10::SymInt(1) : in[0];
  s.c_in = in[1 - off];
  s.h = in[2 - off];
  s.w = in[3 - off];
  const auto ws = weight.sym_sizes();
  s.c_out = ws[0];
  s.kh = ws[2];
  s.kw = ws[3];

  TORCH_SYM_CHECK((s.c_in % groups).sym_eq(0), "input channels (", s.c_in,
                  ") must be divisible by groups (", groups, ")");
  TORCH_SYM_CHECK((s.c_out % groups).sym_eq(0), "weight.size(0) (out_channels = ", s.c_out,
                  ") must be divisible by groups (", groups, ")");
  TORCH_SYM_CHECK((ws[1] * groups).sym_eq(s.c_in), "weight.size(1) * groups (", ws[1], " * ",
                  groups, ") must equal the input channels (", s.c_in, ")");
  TORCH_SYM_CHECK(s.kh.sym_gt(0), "weight kernel height must be positive, got ", s.kh);
  TORCH_SYM_CHECK(s.kw.sym_gt(0), "weight kernel width must be positive, got ", s.kw);
  TORCH_SYM_CHECK(s.c_out.sym_gt(0), "weight.size(0) (out_channels) must be positive");

  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1, "bias must be 1-D [out_channels], got ", bias->dim(), "-D");
    TORCH_SYM_CHECK(bias->sym_size(0).sym_eq(s.c_out), "bias must have out_channels (", s.c_out,
                    ") elements, got ", bias->sym_size(0));
    TORCH_CHECK(bias->device() == input.device(), "bias must be on the same device as input (",
                input.device(), "), got ", bias->device());
    TORCH_CHECK(bias->scalar_type() == input.scalar_type(),
                "bias must have the same dtype as input (", input.scalar_type(), "), got ",
                bias->scalar_type());
  }

  // Output size: floor((size + 2*pad - dilation*(k-1) - 1) / stride) + 1.
  const auto eff_h = s.h + 2 * s.padding[0] - s.dilation[0] * (s.kh - 1) - 1;
  const auto eff_w = s.w + 2 * s.padding[1] - s.dilation[1] * (s.kw - 1) - 1;
  TORCH_SYM_CHECK(eff_h.sym_ge(0).sym_and(eff_w.sym_ge(0)), "input (padded, ",
                  s.h + 2 * s.padding[0], " x ", s.w + 2 * s.padding[1],
                  ") is smaller than the dilated kernel (", s.dilation[0] * (s.kh - 1) + 1, " x ",
                  s.dilation[1] * (s.kw - 1) + 1, "): the output size would be empty");
  s.oh = eff_h / s.stride[0] + 1;
  s.ow = eff_w / s.stride[1] + 1;
  s.layout = conv2d_output_memory_format(input, weight);
  return s;
}

Conv2dShape check_tiled_conv2d_backward_args(const at::Tensor& grad_output, const at::Tensor& input,
                                             const at::Tensor& weight, at::IntArrayRef stride,
                                             at::IntArrayRef padding, at::IntArrayRef dilation,
                                             int64_t groups) {
  Conv2dShape s =
      check_tiled_conv2d_args(input, weight, std::nullopt, stride, padding, dilation, groups);
  TORCH_CHECK(grad_output.defined(), "grad_output must be a defined tensor");
  TORCH_CHECK(grad_output.dim() == input.dim(), "grad_output must be ", input.dim(),
              "-D like input, got ", grad_output.dim(), "-D");
  TORCH_CHECK(grad_output.device() == input.device(),
              "grad_output must be on the same device as input (", input.device(), "), got ",
              grad_output.device());
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(),
              "grad_output must have the same dtype as input (", input.scalar_type(), "), got ",
              grad_output.scalar_type());
  const auto g = grad_output.sym_sizes();
  const int64_t off = s.unbatched ? 1 : 0;
  const bool ok = (s.unbatched || g[0] == s.n) && g[1 - off] == s.c_out && g[2 - off] == s.oh &&
                  g[3 - off] == s.ow;
  TORCH_CHECK(ok, "grad_output must have the forward output's shape [", s.n, ", ", s.c_out, ", ",
              s.oh, ", ", s.ow, "], got ", grad_output.sym_sizes());
  return s;
}

at::MemoryFormat conv2d_output_memory_format(const at::Tensor& input, const at::Tensor& weight) {
  if (input.dim() != 4) return at::MemoryFormat::Contiguous;
  // On CUDA ATen's float64 convolutions are NCHW whatever the layout
  // (cudnn_conv_suggest_memory_format turns NHWC off for double, and the
  // native kernels cuDNN would fall back to are NCHW only). (CUDA read from
  // the dispatch keys: a fake CUDA tensor reports device meta inside the
  // Meta kernel, and must be given the real kernel's layout.)
  if (input.key_set().has_backend(c10::BackendComponent::CUDABit) &&
      (input.scalar_type() == at::kDouble || weight.scalar_type() == at::kDouble)) {
    return at::MemoryFormat::Contiguous;
  }
  // ATen disables NHWC for float64 in its mkldnn path but not in the thnn path
  // that float64 takes; both end at "input or weight suggests channels-last".
  const bool cl = input.suggest_memory_format() == at::MemoryFormat::ChannelsLast ||
                  weight.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
  return cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
}

std::string conv_path_override() {
  const char* env = std::getenv("DDPX_CONV_PATH");
  if (env == nullptr || *env == '\0') return "auto";
  const std::string want = env;
  TORCH_CHECK(want == "auto" || want == "benchmark" || want == "tiled" || want == "direct" ||
                  want == "gemm" || want == "aten",
              "DDPX_CONV_PATH must be one of auto, benchmark, tiled, direct, gemm, aten; got '",
              want, "'");
  return want;
}

tile::ConvGeom conv_geom(const Conv2dShape& s) {
  tile::ConvGeom g;
  g.n = s.n.expect_int();
  g.c = s.c_in.expect_int();
  g.h = s.h.expect_int();
  g.w = s.w.expect_int();
  g.cout = s.c_out.expect_int();
  g.kh = s.kh.expect_int();
  g.kw = s.kw.expect_int();
  g.oh = s.oh.expect_int();
  g.ow = s.ow.expect_int();
  g.sh = s.stride[0];
  g.sw = s.stride[1];
  g.ph = s.padding[0];
  g.pw = s.padding[1];
  g.dh = s.dilation[0];
  g.dw = s.dilation[1];
  g.groups = s.groups;
  g.cig = g.c / g.groups;
  g.cog = g.cout / g.groups;
  return g;
}

}  // namespace ddpx::detail
