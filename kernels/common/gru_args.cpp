// Argument checks of ddpx::fused_gru, shared by the CPU, CUDA and Meta kernels.
// Sizes are symbolic (SymInt) so torch.compile's fake tensors go through the
// same checks; on real tensors every SymInt is a plain integer.
#include <c10/util/Exception.h>

#include <string>

#include "kernels/common/gru_sequence.h"

namespace ddpx::detail {
namespace {

const char* const kCellParamNames[] = {"w_ih", "w_hh", "b_ih", "b_hh"};

// "params[5] (w_hh of layer 1, reverse direction)"
std::string param_name(size_t index, const GruOptions& opt) {
  const int64_t per = opt.params_per_cell();
  const int64_t cell = static_cast<int64_t>(index) / per;
  const int64_t layer = cell / opt.directions();
  const bool reverse = cell % opt.directions() == 1;
  return c10::str("params[", index, "] (", kCellParamNames[index % per], " of layer ", layer,
                  reverse ? ", reverse direction)" : ")");
}

bool same_shape(c10::SymIntArrayRef got, c10::ArrayRef<c10::SymInt> want) {
  if (got.size() != want.size()) return false;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) return false;
  }
  return true;
}

void check_param(at::TensorList params, size_t index, const GruOptions& opt,
                 const at::Tensor& input, std::vector<c10::SymInt> want, const char* layout) {
  const at::Tensor& p = params[index];
  TORCH_CHECK(p.defined(), param_name(index, opt), " is undefined");
  TORCH_CHECK(same_shape(p.sym_sizes(), want), param_name(index, opt), " must be ", layout, " = ",
              c10::SymIntArrayRef(want), ", got ", p.sym_sizes());
  TORCH_CHECK(p.scalar_type() == input.scalar_type(), param_name(index, opt),
              " must have input's dtype ", input.scalar_type(), ", got ", p.scalar_type());
  TORCH_CHECK(p.device() == input.device(), param_name(index, opt), " must be on input's device ",
              input.device(), ", got ", p.device());
}

}  // namespace

GruSizes check_gru_args(const at::Tensor& input, const std::optional<at::Tensor>& hx,
                        at::TensorList params, const GruOptions& opt) {
  TORCH_CHECK(opt.num_layers >= 1, "num_layers must be >= 1, got ", opt.num_layers);
  TORCH_CHECK(opt.dropout >= 0 && opt.dropout <= 1, "dropout must be a probability in [0, 1], got ",
              opt.dropout);
  TORCH_CHECK(input.dim() == 3 || input.dim() == 2,
              "input must be 3-D [seq, batch, input_size] ([batch, seq, input_size] with "
              "batch_first) or 2-D [seq, input_size] (unbatched), got ",
              input.dim(), "-D");
  TORCH_CHECK(at::isFloatingType(input.scalar_type()),
              "input must be a floating point tensor, got ", input.scalar_type());

  const int64_t dirs = opt.directions();
  const int64_t per = opt.params_per_cell();
  const size_t expected = static_cast<size_t>(opt.num_layers * dirs * per);
  TORCH_CHECK(params.size() == expected, "params must hold ", expected, " tensors (w_ih, w_hh",
              opt.has_biases ? ", b_ih, b_hh" : "",
              " per layer and direction) for num_layers=", opt.num_layers,
              ", bidirectional=", opt.bidirectional, ", has_biases=", opt.has_biases, "; got ",
              params.size());

  // hidden_size comes from w_hh of layer 0: [3*hidden_size, hidden_size].
  TORCH_CHECK(params[1].defined() && params[1].dim() == 2, param_name(1, opt),
              " must be 2-D [3*hidden_size, hidden_size], got ",
              params[1].defined() ? params[1].dim() : 0, "-D");
  GruSizes s;
  s.hidden = params[1].sym_size(1);
  s.unbatched = input.dim() == 2;
  s.input_size = input.sym_size(-1);
  if (s.unbatched) {
    s.seq = input.sym_size(0);
    s.batch = 1;
  } else {
    s.seq = input.sym_size(opt.batch_first ? 1 : 0);
    s.batch = input.sym_size(opt.batch_first ? 0 : 1);
  }
  TORCH_CHECK(s.seq > 0, "input must have a sequence length > 0 (as nn.GRU), got input of shape ",
              input.sym_sizes(), opt.batch_first && !s.unbatched ? " with batch_first" : "");
  const c10::SymInt gates3 = s.hidden * 3;

  TORCH_CHECK(params[0].defined() && params[0].dim() == 2 && params[0].sym_size(1) == s.input_size,
              "input has input_size ", s.input_size, " (its last dim) but ", param_name(0, opt),
              " is ", params[0].defined() ? params[0].sym_sizes() : c10::SymIntArrayRef(),
              ": expected [3*hidden_size, input_size] = [", gates3, ", ", s.input_size, "]");
  for (int64_t layer = 0; layer < opt.num_layers; ++layer) {
    const c10::SymInt in = layer == 0 ? s.input_size : s.hidden * dirs;
    for (int64_t d = 0; d < dirs; ++d) {
      const size_t base = static_cast<size_t>((layer * dirs + d) * per);
      check_param(params, base, opt, input, {gates3, in},
                  layer == 0 ? "[3*hidden_size, input_size]"
                             : "[3*hidden_size, num_directions*hidden_size]");
      check_param(params, base + 1, opt, input, {gates3, s.hidden}, "[3*hidden_size, hidden_size]");
      if (opt.has_biases) {
        check_param(params, base + 2, opt, input, {gates3}, "[3*hidden_size]");
        check_param(params, base + 3, opt, input, {gates3}, "[3*hidden_size]");
      }
    }
  }

  if (hx.has_value() && hx->defined()) {
    const c10::SymInt cells = opt.num_layers * dirs;
    TORCH_CHECK(hx->dim() == input.dim(),
                s.unbatched ? "hx must be 2-D [num_layers*num_directions, hidden_size] for "
                              "unbatched 2-D input, got "
                            : "hx must be 3-D [num_layers*num_directions, batch, hidden_size] "
                              "for batched 3-D input, got ",
                hx->dim(), "-D");
    std::vector<c10::SymInt> want = {cells, s.batch, s.hidden};
    if (s.unbatched) want = {cells, s.hidden};
    TORCH_CHECK(same_shape(hx->sym_sizes(), want), "hx must be [num_layers*num_directions, ",
                s.unbatched ? "" : "batch, ", "hidden_size] = ", c10::SymIntArrayRef(want),
                ", got ", hx->sym_sizes());
    TORCH_CHECK(hx->scalar_type() == input.scalar_type(), "hx must have input's dtype ",
                input.scalar_type(), ", got ", hx->scalar_type());
    TORCH_CHECK(hx->device() == input.device(), "hx must be on input's device ", input.device(),
                ", got ", hx->device());
  }
  return s;
}

}  // namespace ddpx::detail
