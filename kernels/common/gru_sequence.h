#pragma once
// Host-side driver of ddpx::fused_gru, shared by every backend: argument
// checks, layer/direction/time loops, the GEMMs (through ATen, so cuBLAS or
// MKL) and dropout. A backend only supplies the fused gate kernel of one time
// step (GruStepKernels); see kernels/common/gru_cell.h for its math.
//
// Layout inside the driver is always [seq, batch, features], contiguous:
//   x_proj, dx_proj, dh_proj   [seq, batch, 3*hidden]   one layer+direction
//   gates (saved)              [layers*dirs, seq, batch, 4*hidden]  r, z, n, hn
//   layer_outputs (saved)      [layers-1, seq, batch, dirs*hidden]  before dropout
//   dropout_masks (saved)      [layers-1, seq, batch, dirs*hidden]  0 or 1/(1-p),
//                              or [0] when no dropout is applied
// params are nn.GRU's _flat_weights: per layer, per direction (forward first):
// w_ih [3*hidden, in], w_hh [3*hidden, hidden], then b_ih, b_hh [3*hidden] if
// has_biases.
#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <vector>

#include "kernels/common/gru_cell.h"
#include "kernels/common/gru_persistent.h"

namespace ddpx::detail {

struct GruOptions {
  bool has_biases = true;
  int64_t num_layers = 1;
  double dropout = 0.0;
  bool train = false;
  bool bidirectional = false;
  bool batch_first = false;

  int64_t directions() const { return bidirectional ? 2 : 1; }
  int64_t params_per_cell() const { return has_biases ? 4 : 2; }
  // nn.GRU applies dropout to the outputs of all layers but the last.
  bool applies_dropout() const { return train && dropout > 0 && num_layers > 1; }
};

// Sizes of a checked call. Symbolic so that the Meta kernels share the checks.
struct GruSizes {
  c10::SymInt seq, batch, input_size, hidden;
  bool unbatched = false;
};

// Checks every argument of fused_gru; the messages name the argument.
GruSizes check_gru_args(const at::Tensor& input, const std::optional<at::Tensor>& hx,
                        at::TensorList params, const GruOptions& opt);

// The fused gate kernel of one time step over all batch rows, for the dtype
// given; pointers live on the tensors' device.
struct GruStepKernels {
  void (*forward)(c10::ScalarType dtype, const GruForwardStep<void>& step) = nullptr;
  void (*backward)(c10::ScalarType dtype, const GruBackwardStep<void>& step) = nullptr;
  // backward fills GruBackwardStep::bias_grad (else the driver sums dx_proj
  // and dh_proj over the sequence afterwards).
  bool sums_bias_grads = false;
  // Optional: one direction's whole recurrence at once (a persistent
  // kernel), returning false where it does not serve the problem; the driver
  // then runs its per-step loop with the two kernels above. The backward one
  // leaves bias sums to the driver.
  bool (*forward_sequence)(c10::ScalarType dtype, const persist::SeqForward<void>& seq) = nullptr;
  bool (*backward_sequence)(c10::ScalarType dtype, const persist::SeqBackward<void>& seq) = nullptr;
};

struct GruForwardResult {
  at::Tensor output;  // user layout: [seq, batch, dirs*hidden], batch_first or unbatched
  at::Tensor h_n;     // [layers*dirs, batch, hidden] ([layers*dirs, hidden] unbatched)
  at::Tensor gates, layer_outputs, dropout_masks;  // saved for backward, see above
};

// save=false is inference: the saved tensors come back undefined and the gate
// kernel writes no workspace.
GruForwardResult gru_sequence_forward(const at::Tensor& input, const std::optional<at::Tensor>& hx,
                                      at::TensorList params, const GruOptions& opt, bool save,
                                      const GruStepKernels& kernels);

struct GruBackwardResult {
  at::Tensor grad_input, grad_hx;
  std::vector<at::Tensor> grad_params;
};

GruBackwardResult gru_sequence_backward(const at::Tensor& grad_output, const at::Tensor& grad_hy,
                                        const at::Tensor& input,
                                        const std::optional<at::Tensor>& hx, at::TensorList params,
                                        const at::Tensor& output, const at::Tensor& gates,
                                        const at::Tensor& layer_outputs,
                                        const at::Tensor& dropout_masks, const GruOptions& opt,
                                        const GruStepKernels& kernels);

}  // namespace ddpx::detail
