#include "ops/fused_gru_tune.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/autograd.h>

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
  f.insert(f.end(), {num_layers, has_biases, dropout_active, bidirectional, batch_first, grad,
                     at::globalContext().allowTF32CuDNN()});
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

}  // namespace ddpx::detail
