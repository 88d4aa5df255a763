#pragma once
// Mixed precision for C++ trainers: ddpx::GradScaler, the contract of
// torch.amp.GradScaler (dynamic loss scaling for float16 training), and
// ddpx::Autocast, torch.autocast as a scope. Low-precision parameters with
// float32 master weights and the dtype gradients are reduced in are
// GradSyncOptions::mixed_precision (grad_sync.h).
//
// A float16 loop (tests/cpp/test_header_examples.cpp runs this text as it
// stands, with `model` a torch::nn module and x, y this rank's part of the
// batch, and checks it against one float32 process on the whole batch):
// [example grad_scaler]
//   ddpx::GradSync sync(model->named_parameters(), ddpx::comm::init_from_env());
//   torch::optim::SGD opt(model->parameters(), 0.1);
//   ddpx::GradScaler scaler;  // torch.amp.GradScaler's settings: 2^16, x2 / 2000 steps, x0.5
//   for (int step = 0; step < 10; ++step) {
//     opt.zero_grad();
//     at::Tensor loss;
//     {
//       ddpx::Autocast fp16(at::kCPU, at::kHalf);  // matmuls in float16, the loss in float32
//       loss = torch::mse_loss(model->forward(x), y);
//     }
//     scaler.scale(loss).backward();  // gradients of loss * scale, averaged across ranks
//     scaler.step(opt);               // unscaled; skipped if any is inf or NaN (on every rank)
//     scaler.update();                // the scale halves after a skip, doubles after 2000 good
//   }
// [end example]
//
// Across ranks. Whether to skip is read from the averaged gradients, which
// are the same on every rank: a non-finite gradient on any rank makes its
// average non-finite (inf + x = inf, inf - inf = NaN, NaN + x = NaN), and
// every codec keeps it so (ddpx/codec.h), so every rank skips the same
// steps with no collective of the scaler's own. Gradients that no such
// reduction averages (a trainer that checks before reducing, or averages
// parameters instead of gradients) need GradScalerOptions::process_group:
// then unscale_ MAX-reduces its inf flag over that group, one 4-byte
// all-reduce per optimizer and step.
//
// With GradSync stepping the optimizer (set_optimizer(optimizer, scaler):
// Overlap::Optimizer, NextForward, or mixed_precision), GradSync unscales
// each bucket's average as it lands, steps every bucket only once all are
// in and finite (else none: the step is skipped on every rank), and calls
// update() itself; the trainer only scales the loss. Its scale() then
// waits for the last step's update (under NextForward it lands while the
// next forward runs).
//
// Not thread-safe beyond that: one trainer thread calls a scaler.
#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ddpx/comm.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace ddpx {

namespace detail {
struct ScalerAccess;  // GradSync's side door (plugin/amp/scaler_access.h)
}

// torch.amp.GradScaler's arguments and defaults.
struct GradScalerOptions {
#define DDPX_AMP_OPT(type, name, def) \
  GradScalerOptions& name(type v) {   \
    name##_ = std::move(v);           \
    return *this;                     \
  }                                   \
  type name##_ = def;
  DDPX_AMP_OPT(double, init_scale, 65536.0)
  DDPX_AMP_OPT(double, growth_factor, 2.0)      // > 1: after growth_interval steps without inf
  DDPX_AMP_OPT(double, backoff_factor, 0.5)     // in (0, 1): after a step with inf or NaN
  DDPX_AMP_OPT(int64_t, growth_interval, 2000)  // > 0
  DDPX_AMP_OPT(bool, enabled, true)             // false: scale() returns its input, step() steps
  // Gradients not averaged by a reduction that carries non-finite values
  // (see "Across ranks" above): the inf flag is MAX-reduced over this group.
  DDPX_AMP_OPT(comm::ProcessGroupPtr, process_group, {})
#undef DDPX_AMP_OPT
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});
  ~GradScaler();
  GradScaler(const GradScaler&) = delete;
  GradScaler& operator=(const GradScaler&) = delete;

  // outputs * scale (float32 scale, on the outputs' device). The first call
  // makes the scale on that device.
  at::Tensor scale(const at::Tensor& outputs);
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs);
  // Divides the optimizer's gradients by the scale, in place, and records
  // whether any is inf or NaN; once per optimizer between update()s, before
  // step (clip gradients after it). float16 gradients are refused (their
  // unscaled values underflow): keep float32 masters (mixed_precision).
  void unscale_(torch::optim::Optimizer& optimizer);
  // unscale_ (unless done) and optimizer.step() unless a gradient was inf
  // or NaN. Returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);
  // The next scale: x backoff_factor if any optimizer stepped since the last
  // update saw inf or NaN, x growth_factor after growth_interval clean steps
  // in a row (ATen's _amp_update_scale_). new_scale: set it instead.
  void update();
  void update(double new_scale);

  double get_scale() const;  // 1.0 when disabled
  double get_growth_factor() const;
  void set_growth_factor(double v);
  double get_backoff_factor() const;
  void set_backoff_factor(double v);
  int64_t get_growth_interval() const;
  void set_growth_interval(int64_t v);
  bool is_enabled() const;

  // torch.amp.GradScaler.state_dict's keys and values ("scale" float,
  // "growth_factor" float, "backoff_factor" float, "growth_interval" int,
  // "_growth_tracker" int; empty when disabled), so either side loads the
  // other's (torch::pickle_save / torch.load). Call between steps.
  // load_state_dict takes a dict IValue with those string keys: this
  // state_dict(), or what torch::pickle_load made of Python's.
  c10::Dict<std::string, c10::IValue> state_dict() const;
  void load_state_dict(const c10::IValue& state);

 private:
  friend struct detail::ScalerAccess;
  struct Impl;
  std::shared_ptr<Impl> impl_;  // (shared with a GradSync it was given to)
};

// torch.autocast(device_type, dtype) as a scope: ops on `device_type` run
// under ATen's autocast policy in `dtype` (float16 or bfloat16; matmuls and
// convolutions in it, losses and reductions in float32) until the guard is
// destroyed; the previous state comes back then. CPU autocast to float16
// needs a torch that supports it (2.4 on).
class Autocast {
 public:
  Autocast(c10::DeviceType device_type, at::ScalarType dtype, bool enabled = true);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType device_;
  bool enabled_, was_enabled_;
  at::ScalarType was_dtype_;
};

}  // namespace ddpx
