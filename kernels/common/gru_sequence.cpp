// The whole-sequence GRU on top of a backend's fused gate step (see
// gru_sequence.h for the layouts). Per layer and direction:
//   forward:  one GEMM for the input projection of all steps, then per step
//             one hidden GEMM into a reused [batch, 3*hidden] buffer and one
//             fused gate kernel; nothing is allocated inside the time loop.
//   backward: per step (in reverse) one fused gate-gradient kernel and one GEMM
//             for dL/dh_{t-1}; after the loop the weight, bias and input
//             gradients as GEMMs/reductions over the whole sequence.
#include "kernels/common/gru_sequence.h"

#include <ATen/ATen.h>

namespace ddpx::detail {
namespace {

struct CellParams {
  at::Tensor w_ih, w_hh, b_ih, b_hh;  // biases undefined without has_biases
};

// Weights of one (layer, direction) cell; `cell` = layer * directions + d.
CellParams cell_params(at::TensorList params, int64_t cell, const GruOptions& opt) {
  const int64_t base = cell * opt.params_per_cell();
  CellParams c{params[base], params[base + 1], {}, {}};
  if (opt.has_biases) {
    // The gate kernel reads both biases through raw pointers.
    c.b_ih = params[base + 2].contiguous();
    c.b_hh = params[base + 3].contiguous();
  }
  return c;
}

void* elem_ptr(const at::Tensor& t, int64_t offset) {
  return static_cast<char*>(t.data_ptr()) + offset * static_cast<int64_t>(t.element_size());
}

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// User layout -> [seq, batch, features] (a view).
at::Tensor to_seq_major(const at::Tensor& t, bool unbatched, bool batch_first) {
  if (unbatched) return t.unsqueeze(1);
  return batch_first ? t.transpose(0, 1) : t;
}

// [seq, batch, features] -> user layout, contiguous.
at::Tensor to_user(const at::Tensor& t, bool unbatched, bool batch_first) {
  if (unbatched) return t.squeeze(1);
  return batch_first ? t.transpose(0, 1).contiguous() : t;
}

// [layers*dirs, batch, hidden] from hx (or zeros when hx is None).
at::Tensor initial_hidden(const std::optional<at::Tensor>& hx, const GruSizes& s, int64_t cells,
                          const at::TensorOptions& options) {
  if (!has(hx)) return at::zeros({cells, s.batch.expect_int(), s.hidden.expect_int()}, options);
  return (s.unbatched ? hx->unsqueeze(1) : *hx).contiguous();
}

// nn.GRU's dropout: keep with probability 1-p, scale kept values by 1/(1-p).
void fill_dropout_mask(at::Tensor& mask, double p) {
  mask.bernoulli_(1 - p);
  if (p < 1) mask.div_(1 - p);
}

// One direction of one layer, forward in time (or backward for reverse).
// x_proj [seq*batch, 3*hidden] is W_ih x without b_ih; out [seq, batch, dirs*hidden]
// gets columns d*hidden..; gates [seq, batch, 4*hidden] or undefined.
void forward_direction(const at::Tensor& x_proj, const CellParams& w, const at::Tensor& h0,
                       const at::Tensor& out, int64_t d, bool reverse, const at::Tensor& gates,
                       const at::Tensor& h_n, at::Tensor& h_proj, const GruStepKernels& kernels) {
  const int64_t T = out.size(0), B = out.size(1), DH = out.size(2), H = h0.size(1);
  const at::Tensor out_d = out.narrow(2, d * H, H);  // [seq, batch, hidden], row stride DH
  if (kernels.forward_sequence != nullptr && T > 0) {
    const at::Tensor w_hh = w.w_hh.contiguous();
    persist::SeqForward<void> q;
    q.steps = T, q.batch = B, q.hidden = H, q.reverse = reverse;
    q.x_proj = x_proj.data_ptr(), q.w_hh = w_hh.data_ptr();
    q.b_ih = w.b_ih.defined() ? w.b_ih.data_ptr() : nullptr;
    q.b_hh = w.b_hh.defined() ? w.b_hh.data_ptr() : nullptr;
    q.h0 = h0.data_ptr(), q.out = elem_ptr(out, d * H), q.out_row = DH, q.out_step = B * DH;
    q.gates = gates.defined() ? gates.data_ptr() : nullptr;
    if (kernels.forward_sequence(out.scalar_type(), q)) {
      h_n.copy_(out_d[reverse ? 0 : T - 1]);
      return;
    }
  }
  const at::Tensor w_hh_t = w.w_hh.t();  // [hidden, 3*hidden]
  GruForwardStep<void> p;
  p.batch = B;
  p.hidden = H;
  p.x_proj_stride = 3 * H;
  p.h_proj = h_proj.data_ptr();
  p.h_proj_stride = 3 * H;
  p.b_hh = w.b_hh.defined() ? w.b_hh.data_ptr() : nullptr;
  p.b_ih = w.b_ih.defined() ? w.b_ih.data_ptr() : nullptr;
  p.h_out_stride = DH;
  for (int64_t step = 0; step < T; ++step) {
    const int64_t t = reverse ? T - 1 - step : step;
    const at::Tensor h_prev = step == 0 ? h0 : out_d[reverse ? t + 1 : t - 1];  // [batch, hidden]
    at::mm_out(h_proj, h_prev, w_hh_t);
    p.x_proj = elem_ptr(x_proj, t * B * 3 * H);
    p.h_prev = h_prev.data_ptr();
    p.h_prev_stride = h_prev.stride(0);
    p.h_out = elem_ptr(out, t * B * DH + d * H);
    p.gates = gates.defined() ? elem_ptr(gates, t * B * 4 * H) : nullptr;
    kernels.forward(out.scalar_type(), p);
  }
  h_n.copy_(T > 0 ? out_d[reverse ? 0 : T - 1] : h0);
}

// BPTT through one direction of one layer. g_out [seq, batch, dirs*hidden] is
// dL/d(layer output); g_hn [batch, hidden] is dL/dh_n of this cell. Fills
// dx_proj and dh_proj [seq, batch, 3*hidden], bias_grad [seq, 4*hidden] when
// defined, and leaves dL/dh0 in dh.
void backward_direction(const at::Tensor& g_out, const CellParams& w, const at::Tensor& h0,
                        const at::Tensor& layer_out, int64_t d, bool reverse,
                        const at::Tensor& gates, const at::Tensor& g_hn, at::Tensor& dx_proj,
                        at::Tensor& dh_proj, at::Tensor& dh, const at::Tensor& bias_grad,
                        const GruStepKernels& kernels) {
  const int64_t T = layer_out.size(0), B = layer_out.size(1), DH = layer_out.size(2);
  const int64_t H = h0.size(1);
  dh.copy_(g_hn);
  if (kernels.backward_sequence != nullptr && !kernels.sums_bias_grads && T > 0) {
    const at::Tensor w_hh = w.w_hh.contiguous();
    persist::SeqBackward<void> q;
    q.steps = T, q.batch = B, q.hidden = H, q.reverse = reverse, q.w_hh = w_hh.data_ptr();
    q.grad_out = elem_ptr(g_out, d * H), q.grad_out_row = DH, q.grad_out_step = B * DH;
    q.gates = gates.data_ptr(), q.h0 = h0.data_ptr();
    q.out = elem_ptr(layer_out, d * H), q.out_row = DH, q.out_step = B * DH;
    q.dx_proj = dx_proj.data_ptr(), q.dh_proj = dh_proj.data_ptr(), q.dh = dh.data_ptr();
    if (kernels.backward_sequence(g_out.scalar_type(), q)) return;
  }
  GruBackwardStep<void> p;
  p.batch = B;
  p.hidden = H;
  p.grad_out_stride = DH;
  p.dh = dh.data_ptr();
  for (int64_t step = T - 1; step >= 0; --step) {
    const int64_t t = reverse ? T - 1 - step : step;
    if (step == 0) {
      p.h_prev = h0.data_ptr();
      p.h_prev_stride = H;
    } else {
      p.h_prev = elem_ptr(layer_out, (reverse ? t + 1 : t - 1) * B * DH + d * H);
      p.h_prev_stride = DH;
    }
    p.grad_out = elem_ptr(g_out, t * B * DH + d * H);
    p.gates = elem_ptr(gates, t * B * 4 * H);
    p.dx_proj = elem_ptr(dx_proj, t * B * 3 * H);
    p.dh_proj = elem_ptr(dh_proj, t * B * 3 * H);
    p.bias_grad = bias_grad.defined() ? elem_ptr(bias_grad, t * 4 * H) : nullptr;
    kernels.backward(g_out.scalar_type(), p);
    dh.addmm_(dh_proj[t], w.w_hh);  // += dh_proj[t] W_hh: [batch, 3*hidden] x [3*hidden, hidden]
  }
}

// dL/dW_hh = sum_t dh_proj[t]^T h_{t-1}: one GEMM for the step that read h0,
// one for all others, whose h_{t-1} are the layer outputs one step away.
at::Tensor hidden_weight_grad(const at::Tensor& dh_proj, const at::Tensor& h0,
                              const at::Tensor& layer_out, int64_t d, bool reverse) {
  const int64_t T = dh_proj.size(0), B = dh_proj.size(1), H3 = dh_proj.size(2), H = h0.size(1);
  if (T == 0) return at::zeros({H3, H}, h0.options());
  at::Tensor g = dh_proj[reverse ? T - 1 : 0].t().mm(h0);  // [3*hidden, hidden]
  if (T > 1) {
    const at::Tensor dg = dh_proj.narrow(0, reverse ? 0 : 1, T - 1).reshape({(T - 1) * B, H3});
    const at::Tensor hp =
        layer_out.narrow(0, reverse ? 1 : 0, T - 1).narrow(2, d * H, H).reshape({(T - 1) * B, H});
    g.addmm_(dg.t(), hp);
  }
  return g;
}

}  // namespace

GruForwardResult gru_sequence_forward(const at::Tensor& input, const std::optional<at::Tensor>& hx,
                                      at::TensorList params, const GruOptions& opt, bool save,
                                      const GruStepKernels& kernels) {
  // Backend kernels: the ATen calls below are never recorded by autograd
  // (the autograd kernel of fused_gru covers them), also when called directly.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const GruSizes s = check_gru_args(input, hx, params, opt);
  const int64_t T = s.seq.expect_int(), B = s.batch.expect_int(), H = s.hidden.expect_int();
  const int64_t D = opt.directions(), L = opt.num_layers;
  const at::TensorOptions o = input.options();

  const at::Tensor x = to_seq_major(input, s.unbatched, opt.batch_first).contiguous();  // [T, B, I]
  const at::Tensor h0 = initial_hidden(hx, s, L * D, o);  // [L*D, B, H]
  GruForwardResult r;
  at::Tensor h_n = at::empty({L * D, B, H}, o);
  if (save) {
    r.gates = at::empty({L * D, T, B, 4 * H}, o);
    r.layer_outputs = at::empty({L - 1, T, B, D * H}, o);
    r.dropout_masks = at::empty({opt.applies_dropout() ? L - 1 : 0, T, B, D * H}, o);
  }
  at::Tensor h_proj = at::empty({B, 3 * H}, o);  // W_hh h_{t-1} of one step, reused
  at::Tensor layer_in = x;                       // [T, B, features of this layer]
  at::Tensor out;                                // [T, B, D*H]
  for (int64_t l = 0; l < L; ++l) {
    const bool last = l == L - 1;
    out = save && !last ? r.layer_outputs[l] : at::empty({T, B, D * H}, o);
    const at::Tensor in2d = layer_in.view({T * B, layer_in.size(2)});
    for (int64_t d = 0; d < D; ++d) {
      const int64_t cell = l * D + d;
      const CellParams w = cell_params(params, cell, opt);
      const at::Tensor x_proj = at::mm(in2d, w.w_ih.t());  // [T*B, 3H], b_ih added per step
      forward_direction(x_proj, w, h0[cell], out, d, /*reverse=*/d == 1,
                        save ? r.gates[cell] : at::Tensor(), h_n[cell], h_proj, kernels);
    }
    if (last) break;
    if (opt.applies_dropout()) {
      at::Tensor mask = save ? r.dropout_masks[l] : at::empty_like(out);
      fill_dropout_mask(mask, opt.dropout);
      layer_in = out * mask;
    } else {
      layer_in = out;
    }
  }
  r.output = to_user(out, s.unbatched, opt.batch_first);
  r.h_n = s.unbatched ? h_n.squeeze(1) : h_n;
  return r;
}

GruBackwardResult gru_sequence_backward(const at::Tensor& grad_output, const at::Tensor& grad_hy,
                                        const at::Tensor& input,
                                        const std::optional<at::Tensor>& hx, at::TensorList params,
                                        const at::Tensor& output, const at::Tensor& gates,
                                        const at::Tensor& layer_outputs,
                                        const at::Tensor& dropout_masks, const GruOptions& opt,
                                        const GruStepKernels& kernels) {
  // Backend kernels: the ATen calls below are never recorded by autograd
  // (the autograd kernel of fused_gru covers them), also when called directly.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const GruSizes s = check_gru_args(input, hx, params, opt);
  const int64_t T = s.seq.expect_int(), B = s.batch.expect_int(), H = s.hidden.expect_int();
  const int64_t D = opt.directions(), L = opt.num_layers;
  const at::TensorOptions o = input.options();
  const auto seq_major = [&](const at::Tensor& t) {
    return to_seq_major(t, s.unbatched, opt.batch_first).contiguous();
  };
  TORCH_CHECK(gates.dim() == 4 && gates.size(0) == L * D && gates.size(1) == T &&
                  gates.size(2) == B && gates.size(3) == 4 * H,
              "gates must be [num_layers*num_directions, seq, batch, 4*hidden_size] as saved by "
              "_fused_gru_forward, got ",
              gates.sizes());
  TORCH_CHECK(layer_outputs.dim() == 4 && layer_outputs.size(0) == L - 1,
              "layer_outputs must be [num_layers-1, seq, batch, num_directions*hidden_size], got ",
              layer_outputs.sizes());
  // Forward saved masks iff it applied dropout; they alone decide here.
  const bool dropped = dropout_masks.numel() > 0;
  TORCH_CHECK(!dropped || dropout_masks.sizes() == layer_outputs.sizes(),
              "dropout_masks must be empty or shaped like layer_outputs ", layer_outputs.sizes(),
              ", got ", dropout_masks.sizes());

  const at::Tensor x = seq_major(input);                  // [T, B, I]
  const at::Tensor h0 = initial_hidden(hx, s, L * D, o);  // [L*D, B, H]
  const at::Tensor out_top = seq_major(output);           // [T, B, D*H]
  at::Tensor g_out = seq_major(grad_output);              // [T, B, D*H]
  const at::Tensor g_hy = (s.unbatched ? grad_hy.unsqueeze(1) : grad_hy).contiguous();
  const at::Tensor gates_c = gates.contiguous();
  const at::Tensor layer_outputs_c = layer_outputs.contiguous();
  const at::Tensor masks_c = dropout_masks.contiguous();

  GruBackwardResult r;
  r.grad_params.resize(params.size());
  r.grad_hx = at::empty({L * D, B, H}, o);
  at::Tensor dx_proj = at::empty({T, B, 3 * H}, o);  // dL/d(W_ih x + b_ih), reused per cell
  at::Tensor dh_proj = at::empty({T, B, 3 * H}, o);  // dL/d(W_hh h + b_hh), reused per cell
  at::Tensor dh = at::empty({B, H}, o);              // dL/dh carried back through time
  // Per-step bias gradient sums [T, 4*H] (r, z, n of x_proj, n of h_proj).
  const at::Tensor bias_grad =
      opt.has_biases && kernels.sums_bias_grads ? at::empty({T, 4 * H}, o) : at::Tensor();
  const at::Tensor dxp = dx_proj.view({T * B, 3 * H});
  const at::Tensor dhp = dh_proj.view({T * B, 3 * H});
  for (int64_t l = L - 1; l >= 0; --l) {
    const at::Tensor layer_out = l == L - 1 ? out_top : layer_outputs_c[l];
    at::Tensor layer_in = x;
    if (l > 0) {
      layer_in = dropped ? layer_outputs_c[l - 1] * masks_c[l - 1] : layer_outputs_c[l - 1];
    }
    const at::Tensor in2d = layer_in.view({T * B, layer_in.size(2)});
    at::Tensor g_in;  // [T*B, features of this layer's input]
    for (int64_t d = 0; d < D; ++d) {
      const int64_t cell = l * D + d;
      const bool reverse = d == 1;
      const CellParams w = cell_params(params, cell, opt);
      backward_direction(g_out, w, h0[cell], layer_out, d, reverse, gates_c[cell], g_hy[cell],
                         dx_proj, dh_proj, dh, bias_grad, kernels);
      r.grad_hx[cell].copy_(dh);
      const int64_t base = cell * opt.params_per_cell();
      r.grad_params[base] = dxp.t().mm(in2d);
      r.grad_params[base + 1] = hidden_weight_grad(dh_proj, h0[cell], layer_out, d, reverse);
      if (bias_grad.defined()) {
        const at::Tensor db = bias_grad.sum(0);  // [4*H]
        r.grad_params[base + 2] = db.narrow(0, 0, 3 * H).clone();
        r.grad_params[base + 3] = at::cat({db.narrow(0, 0, 2 * H), db.narrow(0, 3 * H, H)});
      } else if (opt.has_biases) {
        r.grad_params[base + 2] = dxp.sum(0);
        r.grad_params[base + 3] = dhp.sum(0);
      }
      if (d == 0) {
        g_in = dxp.mm(w.w_ih);
      } else {
        g_in.addmm_(dxp, w.w_ih);
      }
    }
    if (l > 0) {
      g_out = g_in.view({T, B, D * H});
      if (dropped) g_out.mul_(masks_c[l - 1]);
    } else {
      r.grad_input =
          to_user(g_in.view({T, B, s.input_size.expect_int()}), s.unbatched, opt.batch_first);
    }
  }
  if (s.unbatched) r.grad_hx = r.grad_hx.squeeze(1);
  return r;
}

}  // namespace ddpx::detail
