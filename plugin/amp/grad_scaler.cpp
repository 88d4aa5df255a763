// ddpx::GradScaler (ddpx/amp.h): torch.amp.GradScaler's Python logic
// (torch/amp/grad_scaler.py), step for step, over ATen's own kernels, so the
// scale, the growth tracker and the skipped steps equal Python's bit for
// bit (tests/cpp/test_grad_scaler.cpp runs both on the same gradients).
// The side door GradSync uses is plugin/amp/scaler_access.h.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <unordered_map>

#include "plugin/amp/scaler_access.h"
#include "plugin/comm/work_wait.h"

namespace ddpx {

namespace amp {
namespace {

// `t` on `device`, without waiting where that is safe: to a device the copy
// is queued on the stream its readers use; to the CPU it would land in
// pinned memory after the call returned, and the CPU op reading it next
// would not wait for it (a scale on the CPU, gradients on a GPU).
at::Tensor moved_to(const at::Tensor& t, c10::Device device) {
  return t.to(device, /*non_blocking=*/!device.is_cpu());
}

}  // namespace

void unscale_grads(const std::vector<at::Tensor>& params, const at::Tensor& inv_scale,
                   FoundInf& found, bool allow_fp16, const char* who) {
  at::NoGradGuard no_grad;
  // device -> dtype -> gradients, each in the order first seen.
  struct Group {
    c10::Device device;
    at::ScalarType dtype;
    std::vector<at::Tensor> grads;
  };
  std::vector<Group> groups;
  for (const auto& p : params) {
    at::Tensor& g = p.mutable_grad();
    if (!g.defined()) continue;
    TORCH_CHECK(allow_fp16 || g.scalar_type() != at::kHalf, who, ": a parameter of shape ",
                p.sizes(),
                " has a float16 gradient; unscaled it would underflow (as "
                "torch.amp.GradScaler, this refuses float16 gradients). Keep float32 parameters "
                "and autocast to float16, or float16 parameters with float32 masters "
                "(GradSyncOptions::mixed_precision)");
    at::Tensor values = g;
    if (g.is_sparse()) {
      if (g.scalar_type() == at::kHalf) g = g.coalesce();  // (duplicates could overflow)
      values = g._values();
    }
    auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& x) {
      return x.device == values.device() && x.dtype == values.scalar_type();
    });
    if (it == groups.end()) {
      groups.push_back({values.device(), values.scalar_type(), {}});
      it = groups.end() - 1;
    }
    it->grads.push_back(values);
  }
  for (auto& grp : groups) {
    auto f = std::find_if(found.begin(), found.end(),
                          [&](const auto& e) { return e.first == grp.device; });
    if (f == found.end()) {
      found.emplace_back(grp.device, at::zeros({}, at::dtype(at::kFloat).device(grp.device)));
      f = found.end() - 1;
    }
    const at::Tensor inv =
        grp.device == inv_scale.device() ? inv_scale : moved_to(inv_scale, grp.device);
    at::_amp_foreach_non_finite_check_and_unscale_(grp.grads, f->second, inv);
  }
}

at::Tensor combined(const FoundInf& found, c10::Device device) {
  at::Tensor sum;
  for (const auto& [d, t] : found) {
    const at::Tensor here = moved_to(t, device);
    sum = sum.defined() ? sum.add_(here) : here.clone();
  }
  return sum.defined() ? sum : at::zeros({}, at::dtype(at::kFloat).device(device));
}

}  // namespace amp

struct GradScaler::Impl {
  GradScalerOptions o;
  int64_t init_growth_tracker = 0;
  at::Tensor scale, growth_tracker;  // made by the first scale(), on its device
  enum class Stage { Ready, Unscaled, Stepped };
  struct PerOptimizer {
    Stage stage = Stage::Ready;
    amp::FoundInf found;
  };
  std::unordered_map<const torch::optim::Optimizer*, PerOptimizer> per_optimizer;
  // GradSync (scaler_access.h): the optimizer it steps, and whether a step
  // of it has yet to update the scale.
  const torch::optim::Optimizer* attached = nullptr;
  std::mutex mu;
  std::condition_variable cv;
  bool pending = false;

  void wait_for_update() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [this] { return !pending; });
  }
  void check_started(const char* what) const {
    TORCH_CHECK(scale.defined(), "GradScaler::", what,
                ": the scale was never used; call "
                "scaler.scale(loss) and backward on the result first");
  }
  void check_not_attached(const char* what) const {
    TORCH_CHECK(attached == nullptr, "GradScaler::", what,
                ": this scaler was given to "
                "GradSync::set_optimizer, which unscales, steps and updates it as each step's "
                "averages land; the trainer only calls scaler.scale(loss)");
  }
  at::Tensor inv_scale() const { return scale.to(at::kDouble).reciprocal().to(at::kFloat); }
  // _amp_update_scale_ on the sum of `found` (torch's found_inf_combined).
  void update_scale(const at::Tensor& found) {
    at::Tensor f = amp::moved_to(found, scale.device());
    at::_amp_update_scale_(scale, growth_tracker, f, o.growth_factor_, o.backoff_factor_,
                           o.growth_interval_);
  }
};

GradScaler::GradScaler(GradScalerOptions options) : impl_(std::make_shared<Impl>()) {
  auto& I = *impl_;
  I.o = std::move(options);
  if (!I.o.enabled_) return;
  TORCH_CHECK(I.o.growth_factor_ > 1.0, "GradScaler: growth_factor must be > 1.0, got ",
              I.o.growth_factor_);
  TORCH_CHECK(I.o.backoff_factor_ > 0.0 && I.o.backoff_factor_ < 1.0,
              "GradScaler: backoff_factor must be in (0, 1), got ", I.o.backoff_factor_);
  TORCH_CHECK(I.o.growth_interval_ > 0, "GradScaler: growth_interval must be positive, got ",
              I.o.growth_interval_);
  TORCH_CHECK(I.o.init_scale_ > 0.0 && std::isfinite(I.o.init_scale_),
              "GradScaler: init_scale must be positive and finite, got ", I.o.init_scale_);
}

GradScaler::~GradScaler() = default;

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  auto& I = *impl_;
  if (!I.o.enabled_) return outputs;
  TORCH_CHECK(outputs.defined(), "GradScaler::scale: outputs is undefined");
  I.wait_for_update();
  if (!I.scale.defined()) {
    I.scale = at::full({}, I.o.init_scale_, at::dtype(at::kFloat).device(outputs.device()));
    I.growth_tracker =
        at::full({}, I.init_growth_tracker, at::dtype(at::kInt).device(outputs.device()));
  }
  return outputs * amp::moved_to(I.scale, outputs.device());
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> out;
  out.reserve(outputs.size());
  for (const auto& t : outputs) out.push_back(scale(t));
  return out;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  auto& I = *impl_;
  if (!I.o.enabled_) return;
  I.wait_for_update();
  I.check_not_attached("unscale_");
  I.check_started("unscale_");
  auto& st = I.per_optimizer[&optimizer];
  TORCH_CHECK(st.stage != Impl::Stage::Unscaled,
              "GradScaler::unscale_: already called on this "
              "optimizer since the last update()");
  TORCH_CHECK(st.stage != Impl::Stage::Stepped,
              "GradScaler::unscale_: called after step(); "
              "call it before step, once per optimizer between update()s");
  std::vector<at::Tensor> params;
  for (const auto& g : optimizer.param_groups()) {
    params.insert(params.end(), g.params().begin(), g.params().end());
  }
  amp::FoundInf found;
  amp::unscale_grads(params, I.inv_scale(), found, /*allow_fp16=*/false, "GradScaler::unscale_");
  if (I.o.process_group_ && !found.empty()) {
    // Gradients no reduction averaged: every rank takes the worst verdict.
    std::vector<at::Tensor> t{amp::combined(found, I.scale.device())};
    c10d::AllreduceOptions ao;
    ao.reduceOp = c10d::ReduceOp::MAX;
    comm::detail::wait_named(I.o.process_group_->allreduce(t, ao));
    found = {{t[0].device(), t[0]}};
  }
  st.found = std::move(found);
  st.stage = Impl::Stage::Unscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  auto& I = *impl_;
  if (!I.o.enabled_) {
    optimizer.step();
    return true;
  }
  I.wait_for_update();
  I.check_not_attached("step");
  I.check_started("step");
  TORCH_CHECK(I.per_optimizer[&optimizer].stage != Impl::Stage::Stepped,
              "GradScaler::step: already called for this optimizer since the last update()");
  if (I.per_optimizer[&optimizer].stage == Impl::Stage::Ready) unscale_(optimizer);
  auto& st = I.per_optimizer[&optimizer];
  TORCH_CHECK(!st.found.empty(),
              "GradScaler::step: no parameter of the optimizer has a "
              "gradient, so there was nothing to check for inf or NaN");
  double any = 0;
  for (const auto& [d, f] : st.found) any += f.item<double>();
  const bool stepped = any == 0;
  if (stepped) optimizer.step();
  st.stage = Impl::Stage::Stepped;
  return stepped;
}

void GradScaler::update() {
  auto& I = *impl_;
  if (!I.o.enabled_) return;
  I.wait_for_update();
  I.check_not_attached("update");
  I.check_started("update");
  amp::FoundInf all;
  for (const auto& [opt, st] : I.per_optimizer)
    all.insert(all.end(), st.found.begin(), st.found.end());
  TORCH_CHECK(!all.empty(),
              "GradScaler::update: no inf checks were recorded since the last "
              "update (call step or unscale_ first)");
  I.update_scale(amp::combined(all, I.scale.device()));
  I.per_optimizer.clear();
}

void GradScaler::update(double new_scale) {
  auto& I = *impl_;
  if (!I.o.enabled_) return;
  I.wait_for_update();
  I.check_not_attached("update");
  I.check_started("update");
  I.scale.fill_(new_scale);
  I.per_optimizer.clear();
}

double GradScaler::get_scale() const {
  auto& I = *impl_;
  if (!I.o.enabled_) return 1.0;
  I.wait_for_update();
  return I.scale.defined() ? I.scale.item<double>() : I.o.init_scale_;
}

double GradScaler::get_growth_factor() const { return impl_->o.growth_factor_; }
void GradScaler::set_growth_factor(double v) { impl_->o.growth_factor_ = v; }
double GradScaler::get_backoff_factor() const { return impl_->o.backoff_factor_; }
void GradScaler::set_backoff_factor(double v) { impl_->o.backoff_factor_ = v; }
int64_t GradScaler::get_growth_interval() const { return impl_->o.growth_interval_; }
void GradScaler::set_growth_interval(int64_t v) { impl_->o.growth_interval_ = v; }
bool GradScaler::is_enabled() const { return impl_->o.enabled_; }

c10::Dict<std::string, c10::IValue> GradScaler::state_dict() const {
  auto& I = *impl_;
  auto d = c10::impl::toTypedDict<std::string, c10::IValue>(
      c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
  if (!I.o.enabled_) return d;
  d.insert("scale", get_scale());
  d.insert("growth_factor", I.o.growth_factor_);
  d.insert("backoff_factor", I.o.backoff_factor_);
  d.insert("growth_interval", I.o.growth_interval_);
  d.insert("_growth_tracker", I.growth_tracker.defined()
                                  ? static_cast<int64_t>(I.growth_tracker.item<int>())
                                  : I.init_growth_tracker);
  return d;
}

void GradScaler::load_state_dict(const c10::IValue& state) {
  auto& I = *impl_;
  if (!I.o.enabled_) return;
  I.wait_for_update();
  TORCH_CHECK(state.isGenericDict(), "GradScaler::load_state_dict: state must be a dict, got ",
              state.tagKind());
  const c10::impl::GenericDict dict = state.toGenericDict();
  TORCH_CHECK(!dict.empty(),
              "GradScaler::load_state_dict: state is empty, possibly saved from "
              "a disabled GradScaler");
  auto get = [&](const char* key) {
    const auto it = dict.find(c10::IValue(std::string(key)));
    TORCH_CHECK(it != dict.end(), "GradScaler::load_state_dict: state has no '", key,
                "' (keys of torch.amp.GradScaler.state_dict: scale, growth_factor, "
                "backoff_factor, growth_interval, _growth_tracker)");
    const c10::IValue v = it->value();
    TORCH_CHECK(v.isDouble() || v.isInt(), "GradScaler::load_state_dict: '", key,
                "' must be a number, got ", v.tagKind());
    return v;
  };
  const double scale = get("scale").toScalar().to<double>();
  const double growth = get("growth_factor").toScalar().to<double>();
  const double backoff = get("backoff_factor").toScalar().to<double>();
  const c10::IValue interval = get("growth_interval"), tracker = get("_growth_tracker");
  TORCH_CHECK(interval.isInt() && tracker.isInt(),
              "GradScaler::load_state_dict: "
              "growth_interval and _growth_tracker must be integers");
  I.o.init_scale_ = scale;
  if (I.scale.defined()) I.scale.fill_(scale);
  I.o.growth_factor_ = growth;
  I.o.backoff_factor_ = backoff;
  I.o.growth_interval_ = interval.toInt();
  I.init_growth_tracker = tracker.toInt();
  if (I.growth_tracker.defined()) I.growth_tracker.fill_(I.init_growth_tracker);
}

// ---- GradSync's side door (scaler_access.h) ----------------------------------

namespace detail {

ScalerAccess::Handle ScalerAccess::attach(GradScaler& s, const torch::optim::Optimizer* optimizer) {
  auto& I = *s.impl_;
  I.wait_for_update();
  TORCH_CHECK(I.per_optimizer.empty(),
              "GradSync::set_optimizer: the GradScaler has unscaled or "
              "stepped an optimizer since its last update(); call update() before giving it to "
              "GradSync");
  I.attached = optimizer;
  return s.impl_;
}

void ScalerAccess::detach(const Handle& h) {
  h->wait_for_update();
  h->attached = nullptr;
}

bool ScalerAccess::enabled(const Handle& h) { return h->o.enabled_; }

void ScalerAccess::check_started(const Handle& h) {
  TORCH_CHECK(h->scale.defined(),
              "GradSync: the GradScaler given to set_optimizer has not "
              "scaled a loss yet; backward on scaler.scale(loss), not on the loss");
}

at::Tensor ScalerAccess::begin_step(const Handle& h) {
  check_started(h);
  {
    std::lock_guard<std::mutex> lock(h->mu);
    h->pending = true;
  }
  return h->inv_scale();
}

void ScalerAccess::finish_step(const Handle& h, const at::Tensor& found) {
  if (found.defined()) h->update_scale(found);
  {
    std::lock_guard<std::mutex> lock(h->mu);
    h->pending = false;
  }
  h->cv.notify_all();
}

}  // namespace detail
}  // namespace ddpx
