// Autograd kernels of ddpx::fused_gru. Forward runs _fused_gru_forward and
// saves its workspace (gates, inner layer outputs, dropout masks); backward
// runs _fused_gru_backward. Double backward is not supported and says so.
#include <ATen/core/grad_mode.h>
#include <ddpx/ops.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/fused_gru.h"
#include "ops/fused_gru_tune.h"

namespace ddpx {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Arguments after params: has_biases, num_layers, dropout, train,
// bidirectional, batch_first; each gets an undefined gradient.
constexpr size_t kTrailingNonTensorArgs = 6;

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// Saved tensors, in this order, then the params.
enum Saved : size_t { kInput, kHx, kOutput, kGates, kLayerOutputs, kMasks, kParams };

class FusedGruFunction : public torch::autograd::Function<FusedGruFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const std::optional<at::Tensor>& hx, at::TensorList params,
                               bool has_biases, int64_t num_layers, double dropout, bool train,
                               bool bidirectional, bool batch_first) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [output, h_n, gates, layer_outputs, masks] = detail::_fused_gru_forward(
        input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first);
    std::vector<at::Tensor> saved = {
        input, has(hx) ? *hx : at::Tensor(), output, gates, layer_outputs, masks};
    saved.insert(saved.end(), params.begin(), params.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["has_hx"] = has(hx);
    ctx->saved_data["has_biases"] = has_biases;
    ctx->saved_data["num_layers"] = num_layers;
    ctx->saved_data["bidirectional"] = bidirectional;
    ctx->saved_data["batch_first"] = batch_first;
    return {output, h_n};
  }

  // grads = (dL/doutput, dL/dh_n), zeros where unused (materialized).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const bool has_hx = ctx->saved_data["has_hx"].toBool();
    const std::vector<at::Tensor> params(saved.begin() + kParams, saved.end());
    auto [grad_input, grad_hx, grad_params] = detail::_fused_gru_backward(
        grads[0], grads[1], saved[kInput],
        has_hx ? std::optional<at::Tensor>(saved[kHx]) : std::nullopt, params, saved[kOutput],
        saved[kGates], saved[kLayerOutputs], saved[kMasks], ctx->saved_data["has_biases"].toBool(),
        ctx->saved_data["num_layers"].toInt(), ctx->saved_data["bidirectional"].toBool(),
        ctx->saved_data["batch_first"].toBool());
    variable_list out = {grad_input, has_hx ? grad_hx : at::Tensor()};
    out.insert(out.end(), grad_params.begin(), grad_params.end());
    out.resize(out.size() + kTrailingNonTensorArgs);
    return out;
  }
};

// Makes _fused_gru_backward's outputs part of the graph only to fail clearly
// when someone differentiates through them (create_graph=True, then grad).
class FusedGruBackwardFunction : public torch::autograd::Function<FusedGruBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad_output,
                               const at::Tensor& grad_hy, const at::Tensor& input,
                               const std::optional<at::Tensor>& hx, at::TensorList params,
                               const at::Tensor& output, const at::Tensor& gates,
                               const at::Tensor& layer_outputs, const at::Tensor& dropout_masks,
                               bool has_biases, int64_t num_layers, bool bidirectional,
                               bool batch_first) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [grad_input, grad_hx, grad_params] = detail::_fused_gru_backward(
        grad_output, grad_hy, input, hx, params, output, gates, layer_outputs, dropout_masks,
        has_biases, num_layers, bidirectional, batch_first);
    variable_list out = {grad_input, grad_hx};
    out.insert(out.end(), grad_params.begin(), grad_params.end());
    return out;
  }

  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false, "double backward of ddpx::fused_gru is not supported");
  }
};

bool needs_grad(const at::Tensor& input, const std::optional<at::Tensor>& hx,
                at::TensorList params) {
  if (!at::GradMode::is_enabled()) return false;
  if (input.requires_grad() || (has(hx) && hx->requires_grad())) return true;
  for (const at::Tensor& p : params) {
    if (p.defined() && p.requires_grad()) return true;
  }
  return false;
}

std::tuple<at::Tensor, at::Tensor> fused_gru_autograd(const at::Tensor& input,
                                                      const std::optional<at::Tensor>& hx,
                                                      at::TensorList params, bool has_biases,
                                                      int64_t num_layers, double dropout,
                                                      bool train, bool bidirectional,
                                                      bool batch_first) {
  if (!needs_grad(input, hx, params)) {
    // Inference: the backend's fused_gru, which keeps no workspace and on
    // CUDA picks cuDNN or ours itself (as it must when reached without this
    // kernel: torch.inference_mode skips it).
    at::AutoDispatchBelowADInplaceOrView guard;
    return fused_gru(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                     batch_first);
  }
  const auto ours = [&]() -> std::tuple<at::Tensor, at::Tensor> {
    const variable_list r = FusedGruFunction::apply(input, hx, params, has_biases, num_layers,
                                                    dropout, train, bidirectional, batch_first);
    return {r[0], r[1]};
  };
  if (!input.is_cuda()) return ours();
  // On CUDA: cuDNN's GRU where the rule says it wins (ops/fused_gru_cuda_path.h),
  // or the faster of the two measured per problem (ops/fused_gru_tune.h).
  return detail::gru_on_cuda_path(input, hx, params, has_biases, num_layers, dropout, train,
                                  bidirectional, batch_first, /*grad=*/true, ours);
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> fused_gru_backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& grad_hy, const at::Tensor& input,
    const std::optional<at::Tensor>& hx, at::TensorList params, const at::Tensor& output,
    const at::Tensor& gates, const at::Tensor& layer_outputs, const at::Tensor& dropout_masks,
    bool has_biases, int64_t num_layers, bool bidirectional, bool batch_first) {
  const variable_list r = FusedGruBackwardFunction::apply(
      grad_output, grad_hy, input, hx, params, output, gates, layer_outputs, dropout_masks,
      has_biases, num_layers, bidirectional, batch_first);
  return {r[0], r[1], std::vector<at::Tensor>(r.begin() + 2, r.end())};
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpx, Autograd, m) {
  m.impl("fused_gru", &fused_gru_autograd);
  m.impl("_fused_gru_backward", &fused_gru_backward_autograd);
}

}  // namespace ddpx
