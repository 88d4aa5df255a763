// Meta (shape-only) kernels of ddpx::fused_gru and its forward/backward ops,
// for torch.compile and fake tensors. Same argument checks as the real
// kernels; sizes stay symbolic. Every output is contiguous, as the real ones.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kernels/common/gru_sequence.h"

namespace ddpx {
namespace {

using detail::GruOptions;
using detail::GruSizes;
using SymShape = std::vector<c10::SymInt>;

at::Tensor empty(const SymShape& shape, const at::Tensor& like) {
  return at::empty_symint(shape, like.options());
}

// [seq, batch, D*H] in the user's layout.
SymShape output_shape(const GruSizes& s, const GruOptions& opt) {
  const c10::SymInt features = s.hidden * opt.directions();
  if (s.unbatched) return {s.seq, features};
  return opt.batch_first ? SymShape{s.batch, s.seq, features} : SymShape{s.seq, s.batch, features};
}

SymShape hidden_shape(const GruSizes& s, const GruOptions& opt) {
  const c10::SymInt cells = opt.num_layers * opt.directions();
  return s.unbatched ? SymShape{cells, s.hidden} : SymShape{cells, s.batch, s.hidden};
}

std::tuple<at::Tensor, at::Tensor> fused_gru_meta(const at::Tensor& input,
                                                  const std::optional<at::Tensor>& hx,
                                                  at::TensorList params, bool has_biases,
                                                  int64_t num_layers, double dropout, bool train,
                                                  bool bidirectional, bool batch_first) {
  const GruOptions opt{has_biases, num_layers, dropout, train, bidirectional, batch_first};
  const GruSizes s = detail::check_gru_args(input, hx, params, opt);
  return {empty(output_shape(s, opt), input), empty(hidden_shape(s, opt), input)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_gru_forward_meta(
    const at::Tensor& input, const std::optional<at::Tensor>& hx, at::TensorList params,
    bool has_biases, int64_t num_layers, double dropout, bool train, bool bidirectional,
    bool batch_first) {
  const GruOptions opt{has_biases, num_layers, dropout, train, bidirectional, batch_first};
  const GruSizes s = detail::check_gru_args(input, hx, params, opt);
  const int64_t cells = num_layers * opt.directions();
  const c10::SymInt features = s.hidden * opt.directions();
  const int64_t masks = opt.applies_dropout() ? num_layers - 1 : 0;
  return {empty(output_shape(s, opt), input), empty(hidden_shape(s, opt), input),
          empty({cells, s.seq, s.batch, s.hidden * 4}, input),
          empty({num_layers - 1, s.seq, s.batch, features}, input),
          empty({masks, s.seq, s.batch, features}, input)};
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> fused_gru_backward_meta(
    const at::Tensor& grad_output, const at::Tensor& grad_hy, const at::Tensor& input,
    const std::optional<at::Tensor>& hx, at::TensorList params, const at::Tensor& output,
    const at::Tensor& gates, const at::Tensor& layer_outputs, const at::Tensor& dropout_masks,
    bool has_biases, int64_t num_layers, bool bidirectional, bool batch_first) {
  const GruOptions opt{has_biases, num_layers, 0.0, false, bidirectional, batch_first};
  const GruSizes s = detail::check_gru_args(input, hx, params, opt);
  std::vector<at::Tensor> grad_params;
  grad_params.reserve(params.size());
  for (const at::Tensor& p : params) grad_params.push_back(empty(p.sym_sizes().vec(), p));
  return {empty(input.sym_sizes().vec(), input), empty(hidden_shape(s, opt), input),
          std::move(grad_params)};
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpx, Meta, m) {
  m.impl("fused_gru", &fused_gru_meta);
  m.impl("_fused_gru_forward", &fused_gru_forward_meta);
  m.impl("_fused_gru_backward", &fused_gru_backward_meta);
}

}  // namespace ddpx
