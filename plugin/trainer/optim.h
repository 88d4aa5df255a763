#pragma once
// Optimizers and the learning-rate schedule of ddpx-train.
#include <torch/optim/optimizer.h>

#include <memory>
#include <vector>

#include "plugin/trainer/options.h"

namespace ddpx::trainer {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<at::Tensor> params,
                                                        const Options& o);

// The learning rate of step `step` (0-based) of `total`: linear warm-up to
// --lr over --warmup-steps, then constant, cosine to zero, or x0.1 at 50% and
// again at 75% of the run.
double lr_at(int64_t step, int64_t total, const Options& o);

void set_lr(torch::optim::Optimizer& opt, double lr);

// Moves SGD's or Adam's per-parameter state to `device` (a checkpoint is read
// on the CPU, whatever device wrote it).
void optimizer_state_to(torch::optim::Optimizer& opt, at::Device device);

}  // namespace ddpx::trainer
