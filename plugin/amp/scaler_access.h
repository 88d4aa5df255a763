#pragma once
// What GradSync does to a GradScaler when it steps the optimizer itself
// (GradSync::set_optimizer(optimizer, scaler)), and the unscaling both use.
// GradSync unscales each bucket's average as it lands (unscale_grads into
// one found_inf per step), decides once every bucket is in, and updates the
// scale (finish_step); meanwhile the scale is `pending`, so the trainer's
// next scale() waits for the update (NextForward completes a step on a
// worker thread while the next forward runs).
#include <ddpx/amp.h>

#include <memory>
#include <utility>
#include <vector>

namespace ddpx {
namespace amp {

// found_inf per device (float32, 0-dim), as torch's _MultiDeviceReplicator.
using FoundInf = std::vector<std::pair<c10::Device, at::Tensor>>;

// Divides the .grad of each tensor in `params` (skipping undefined ones; a
// sparse one's values) by 1 / inv_scale in place, grouped by device and
// dtype as torch.amp.GradScaler._unscale_grads_ does, and sets the device's
// found_inf to 1 where a gradient is inf or NaN. float16 gradients are
// refused unless allow_fp16. `who` starts error messages.
void unscale_grads(const std::vector<at::Tensor>& params, const at::Tensor& inv_scale,
                   FoundInf& found, bool allow_fp16, const char* who);

// Their sum on `device` (0 when `found` is empty).
at::Tensor combined(const FoundInf& found, c10::Device device);

}  // namespace amp

namespace detail {

struct ScalerAccess {
  // The scaler's state, held by GradSync as long as it needs it (a scaler
  // destroyed before its GradSync leaves it behind).
  using Handle = std::shared_ptr<GradScaler::Impl>;
  // GradSync now steps `optimizer` under `s`: the trainer's own unscale_,
  // step and update are refused (they would unscale twice).
  static Handle attach(GradScaler& s, const torch::optim::Optimizer* optimizer);
  // Released (GradSync's destructor, or set_optimizer again).
  static void detach(const Handle& h);
  static bool enabled(const Handle& h);
  // Throws unless scale() has made the scale (the trainer scaled the loss).
  static void check_started(const Handle& h);
  // The step's inverse scale (float32, 0-dim, on the scale's device), for
  // unscale_grads; marks the scale pending.
  static at::Tensor begin_step(const Handle& h);
  // The step's verdict (non-zero: inf or NaN somewhere) becomes the next
  // scale (_amp_update_scale_); the scale is no longer pending. found:
  // undefined when the step failed before a verdict (nothing updated).
  static void finish_step(const Handle& h, const at::Tensor& found);
};

}  // namespace detail
}  // namespace ddpx
