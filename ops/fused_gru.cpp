// ddpx::fused_gru: a whole-sequence GRU, drop-in for torch.nn.GRU (same
// flat-weights order, gate order r, z, n and semantics), with the gate math of
// each step fused into one kernel. Backward is its own op; see
// kernels/common/gru_sequence.h for the algorithm and the saved tensors.
#include "ops/fused_gru.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ddpx/ops.h>
#include <torch/library.h>

namespace ddpx {

std::tuple<at::Tensor, at::Tensor> fused_gru(const at::Tensor& input,
                                             const std::optional<at::Tensor>& hx,
                                             at::TensorList params, bool has_biases,
                                             int64_t num_layers, double dropout, bool train,
                                             bool bidirectional, bool batch_first) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::fused_gru", "")
                       .typed<decltype(fused_gru)>();
  return op.call(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                 batch_first);
}

std::string fused_gru_path(const at::Tensor& input, int64_t hidden_size, bool batch_first) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::fused_gru_path", "")
                       .typed<decltype(fused_gru_path)>();
  return op.call(input, hidden_size, batch_first);
}

namespace detail {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> _fused_gru_forward(
    const at::Tensor& input, const std::optional<at::Tensor>& hx, at::TensorList params,
    bool has_biases, int64_t num_layers, double dropout, bool train, bool bidirectional,
    bool batch_first) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::_fused_gru_forward", "")
                       .typed<decltype(_fused_gru_forward)>();
  return op.call(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                 batch_first);
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> _fused_gru_backward(
    const at::Tensor& grad_output, const at::Tensor& grad_hy, const at::Tensor& input,
    const std::optional<at::Tensor>& hx, at::TensorList params, const at::Tensor& output,
    const at::Tensor& gates, const at::Tensor& layer_outputs, const at::Tensor& dropout_masks,
    bool has_biases, int64_t num_layers, bool bidirectional, bool batch_first) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpx::_fused_gru_backward", "")
                       .typed<decltype(_fused_gru_backward)>();
  return op.call(grad_output, grad_hy, input, hx, params, output, gates, layer_outputs,
                 dropout_masks, has_biases, num_layers, bidirectional, batch_first);
}

}  // namespace detail

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  // Dropout draws from the default generator in training, hence the tag.
  m.def(
      "fused_gru(Tensor input, Tensor? hx, Tensor[] params, bool has_biases, int num_layers, "
      "float dropout, bool train, bool bidirectional, bool batch_first) -> (Tensor, Tensor)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "_fused_gru_forward(Tensor input, Tensor? hx, Tensor[] params, bool has_biases, "
      "int num_layers, float dropout, bool train, bool bidirectional, bool batch_first) -> "
      "(Tensor output, Tensor h_n, Tensor gates, Tensor layer_outputs, Tensor dropout_masks)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "_fused_gru_backward(Tensor grad_output, Tensor grad_hy, Tensor input, Tensor? hx, "
      "Tensor[] params, Tensor output, Tensor gates, Tensor layer_outputs, "
      "Tensor dropout_masks, bool has_biases, int num_layers, bool bidirectional, "
      "bool batch_first) -> (Tensor grad_input, Tensor grad_hx, Tensor[] grad_params)");
  // How the gate kernel of one time step runs for this input on its device
  // ("serial" or "batch-parallel:<tasks>" on CPU): the benchmark prints it.
  m.def("fused_gru_path(Tensor input, int hidden_size, bool batch_first=False) -> str");
}

}  // namespace ddpx
