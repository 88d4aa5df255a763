#include "ops/fused_gru_tune.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/autograd.h>

#include "ops/fused_gru_cuda_path.h"

namespace ddpx::detail {

ConvTuneKey gru_tune_key(const at::Tensor& input, at::TensorList params, bool has_biases,
                         int64_t num_layers, bool dropout_active, bool bidirectional,
                         bool batch_first, bool grad) {
  // (-2 first: a tiled_conv2d key starts with a device type, the tuner's
  // tests' keys with -1)
  std::vector<int64_t> f = {-2, static_cast<int64_t>(input.device().type()), input.device().index(),
                            static_cast<int64_t>(input.scalar_type()), input.dim()};
  for (const int64_t s : input.sizes()) f.push_back(s);
  f.push_back(params.size() >= 2 ? params[1].size(1) : 0);  // hidden: w_hh_l0 [3h, h]
  // TF32: cuDNN's RNN flag (asked for the RNN op: without one, the getter
  // throws once conv's and RNN's flags differ) and cuBLAS's, which our
  // input-projection GEMMs run under.
  const auto& ctx = at::globalContext();
  f.insert(f.end(), {num_layers, has_biases, dropout_active, bidirectional, batch_first, grad,
                     ctx.allowTF32CuDNN(at::Float32Op::RNN), ctx.allowTF32CuBLAS()});
  return ConvTuneKey{std::move(f)};
}

GruOutputs gru_tune(const ConvTuneKey& key, c10::Device device, int count,
                    const std::function<GruOutputs(int)>& run,
                    const std::vector<at::Tensor>& grad_inputs) {
  return conv_tune<GruOutputs>(key, device, count, [&](int i) {
    GruOutputs out = run(i);
    if (!grad_inputs.empty()) {
      const auto& [y, h_n] = out;
      torch::autograd::grad({y, h_n}, grad_inputs, {at::ones_like(y), at::ones_like(h_n)},
                            /*retain_graph=*/true, /*create_graph=*/false, /*allow_unused=*/true);
    }
    return out;
  });
}

namespace {

// A tensor with data to time: not one being traced (fake, functional or
// symbolic-sized: torch.compile and export run the Autograd kernel on those).
bool measurable(const at::Tensor& t) {
  constexpr c10::DispatchKeySet traced({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
  return !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() && !t.key_set().has_any(traced);
}

// Benchmark mode: the measured choice of this call's problem (gru_on_cuda_path).
GruOutputs measured(const at::Tensor& input, const std::optional<at::Tensor>& hx,
                    at::TensorList params, bool has_biases, int64_t num_layers,
                    bool dropout_active, bool bidirectional, bool batch_first, bool grad,
                    const std::function<GruOutputs()>& cudnn,
                    const std::function<GruOutputs()>& ours) {
  const bool has_hx = hx.has_value() && hx->defined();
  bool real = measurable(input) && (!has_hx || measurable(*hx));
  for (const at::Tensor& p : params) real = real && (!p.defined() || measurable(p));
  if (!real) return cudnn();
  const ConvTuneKey key = gru_tune_key(input, params, has_biases, num_layers, dropout_active,
                                       bidirectional, batch_first, grad);
  if (const auto got = conv_tuned_choice(key)) return *got == 0 ? cudnn() : ours();
  if (gru_stream_capturing(input.device())) return cudnn();
  std::vector<at::Tensor> grad_inputs;
  if (grad) {
    if (input.requires_grad()) grad_inputs.push_back(input);
    if (has_hx && hx->requires_grad()) grad_inputs.push_back(*hx);
    for (const at::Tensor& p : params) {
      if (p.defined() && p.requires_grad()) grad_inputs.push_back(p);
    }
  }
  return gru_tune(key, input.device(), 2, [&](int i) { return i == 0 ? cudnn() : ours(); },
                  grad_inputs);
}

}  // namespace

GruOutputs gru_on_cuda_path(const at::Tensor& input, const std::optional<at::Tensor>& hx,
                            at::TensorList params, bool has_biases, int64_t num_layers,
                            double dropout, bool train, bool bidirectional, bool batch_first,
                            bool grad, const std::function<GruOutputs()>& ours) {
  const auto cudnn = [&] {
    return gru_through_cudnn(input, hx, params, has_biases, num_layers, dropout, train,
                             bidirectional, batch_first);
  };
  switch (gru_cuda_path_choice()) {
    case GruCudaPath::kAuto:
      if (params.size() < 2 ||
          gru_auto_path(input, params[1].size(1), batch_first) == GruCudaPath::kCudnn) {
        return cudnn();
      }
      break;
    case GruCudaPath::kCudnn:
      return cudnn();
    case GruCudaPath::kBenchmark:
      return measured(input, hx, params, has_biases, num_layers, train && dropout > 0,
                      bidirectional, batch_first, grad, cudnn, ours);
    case GruCudaPath::kFused:
    case GruCudaPath::kStep:
      break;
  }
  return ours();
}

}  // namespace ddpx::detail
