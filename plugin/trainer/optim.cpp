#include "plugin/trainer/optim.h"

#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <cmath>

namespace ddpx::trainer {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<at::Tensor> params,
                                                        const Options& o) {
  if (o.optimizer == "adam") {
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(o.lr).weight_decay(o.weight_decay));
  }
  TORCH_CHECK(o.optimizer == "sgd", "ddpx-train: --optimizer must be sgd or adam, got '",
              o.optimizer, "'");
  return std::make_unique<torch::optim::SGD>(
      params, torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
}

double lr_at(int64_t step, int64_t total, const Options& o) {
  if (step < o.warmup_steps) return o.lr * double(step + 1) / double(o.warmup_steps);
  const double done = total > o.warmup_steps
                          ? double(step - o.warmup_steps) / double(total - o.warmup_steps)
                          : 1.0;
  if (o.lr_schedule == "cosine") return o.lr * 0.5 * (1.0 + std::cos(M_PI * done));
  if (o.lr_schedule == "step") return o.lr * (done >= 0.75 ? 0.01 : done >= 0.5 ? 0.1 : 1.0);
  return o.lr;
}

void optimizer_state_to(torch::optim::Optimizer& opt, at::Device device) {
  using namespace torch::optim;
  auto move = [&](const at::Tensor& t) { return t.defined() ? t.to(device) : t; };
  for (auto& [key, state] : opt.state()) {
    if (auto* s = dynamic_cast<SGDParamState*>(state.get())) {
      s->momentum_buffer(move(s->momentum_buffer()));
    } else if (auto* a = dynamic_cast<AdamParamState*>(state.get())) {
      a->exp_avg(move(a->exp_avg()));
      a->exp_avg_sq(move(a->exp_avg_sq()));
      a->max_exp_avg_sq(move(a->max_exp_avg_sq()));
    } else {
      TORCH_CHECK(false, "ddpx-train: cannot move the state of this optimizer to ", device);
    }
  }
}

void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& group : opt.param_groups()) group.options().set_lr(lr);
}

}  // namespace ddpx::trainer
