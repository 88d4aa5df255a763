// Float32 masters of low-precision parameters (plugin/amp/master_weights.h).
#include "plugin/amp/master_weights.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

namespace ddpx::amp {

void convert_in_place(const at::Tensor& t, at::ScalarType dtype) {
  if (t.scalar_type() == dtype) return;
  at::NoGradGuard no_grad;
  t.mutable_grad() = at::Tensor();
  // set_data keeps the TensorImpl (and requires_grad); the data is new.
  const_cast<at::Tensor&>(t).set_data(t.detach().to(dtype));
}

MasterWeights::MasterWeights(const std::vector<at::Tensor>& params, at::ScalarType param_dtype)
    : params_(params) {
  at::NoGradGuard no_grad;
  for (const auto& p : params_) {
    masters_.push_back(p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
    convert_in_place(p, param_dtype);
  }
}

void MasterWeights::write(const std::vector<int>& ps) const {
  if (!active()) return;
  at::NoGradGuard no_grad;
  for (int p : ps) params_[p].copy_(masters_[p]);
}

void MasterWeights::load(const std::vector<at::Tensor>& values,
                         const std::vector<std::string>& names) {
  TORCH_CHECK(values.size() == masters_.size(),
              "GradSync::load_state: masters must be one per "
              "parameter (",
              masters_.size(), "), got ", values.size());
  for (size_t p = 0; p < values.size(); ++p) {
    TORCH_CHECK(values[p].defined() && values[p].sizes() == masters_[p].sizes(),
                "GradSync::load_state: master of '", names[p], "' is ",
                values[p].defined() ? values[p].sizes() : at::IntArrayRef{}, ", its parameter ",
                masters_[p].sizes());
  }
  at::NoGradGuard no_grad;
  for (size_t p = 0; p < values.size(); ++p) {
    masters_[p].copy_(values[p]);
    params_[p].copy_(masters_[p]);
  }
}

}  // namespace ddpx::amp
