// GradSync: wiring of the parts (order predictor, bucket planner, channels,
// unused-parameter handling). The step protocol is in grad_sync.h.
#include <ddpx/grad_sync.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/jit/api/module.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <unordered_set>

#include "hooks/bucket_planner.h"
#include "hooks/channel.h"
#include "hooks/grad_sync_setup.h"
#include "hooks/order_predictor.h"
#include "hooks/profiler.h"
#include "hooks/reduce_fn.h"

namespace ddpx {
namespace {

using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double, std::micro>(t - t0).count();
}

}  // namespace

struct GradSync::Impl {
  // ---- fixed at construction ------------------------------------------------
  std::vector<std::string> names;
  std::vector<at::Tensor> params;  // requires_grad parameters only
  std::vector<hooks::ParamInfo> info;
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> accumulators;  // keep hooks alive
  std::shared_ptr<std::atomic<Impl*>> alive;  // what the hooks call; null once destroyed
  GradSyncOptions opts;
  std::vector<std::unique_ptr<hooks::Channel>> channels;
  hooks::ReduceFn reduce;
  hooks::WireStatsFn wire_stats;
  std::unique_ptr<hooks::Profiler> profiler;
  int world = 1;

  // ---- the plan (changes only at step boundaries) ---------------------------
  std::vector<hooks::BucketPlan> plan;
  std::vector<at::Tensor> storage;       // flat bucket tensors
  std::vector<int> bucket_of, offset_of;  // per parameter
  std::vector<at::Tensor> views;          // per parameter: its slot, shaped like it
  std::vector<std::string> keys;          // per bucket: the codec's state key
  hooks::OrderPredictor predictor;
  int64_t replans = 0;

  // ---- per-step state, under mu ---------------------------------------------
  std::mutex mu;
  bool active = false;
  std::atomic<bool> no_sync{false};
  std::vector<char> ready;
  std::vector<int> pending;  // per bucket: gradients still missing
  int next_launch = 0;
  std::vector<int> arrival;
  std::vector<std::future<void>> futures;
  std::vector<char> expected_unused;  // Exact: from prepare_for_backward
  StepStats stats, last;
  Clock::time_point t0;
  Clock::time_point agree_t0, agree_t1;  // the step-end agreement, on channel 0
  std::atomic<double> hook_cpu_us{0};

  Impl(GradSyncOptions o, int n) : opts(std::move(o)), predictor(n) {}

  void replan(const std::vector<int>& order) {
    plan = hooks::plan_buckets(order, info,
                               static_cast<int64_t>(opts.first_bucket_mb_ * (1 << 20)),
                               static_cast<int64_t>(opts.bucket_cap_mb_ * (1 << 20)));
    storage.clear();
    keys.clear();
    bucket_of.assign(params.size(), -1);
    offset_of.assign(params.size(), 0);
    views.assign(params.size(), at::Tensor());
    for (size_t b = 0; b < plan.size(); ++b) {
      storage.push_back(at::zeros({plan[b].numel},
                                  at::TensorOptions().dtype(plan[b].dtype).device(plan[b].device)));
      keys.push_back("bucket" + std::to_string(b));
      int64_t off = 0;
      for (int p : plan[b].params) {
        bucket_of[p] = static_cast<int>(b);
        offset_of[p] = static_cast<int>(off);
        // detach(): an alias, not an autograd view; LibTorch's
        // Optimizer::zero_grad calls detach_() on .grad, which views reject.
        views[p] = storage[b].narrow(0, off, info[p].numel).view(params[p].sizes()).detach();
        off += info[p].numel;
      }
    }
  }

  // Is `g` (a parameter's .grad) the bucket slot itself? Then backward has
  // already accumulated into the bucket and there is nothing to copy. After a
  // re-plan, grads still viewing the old storage are not: they are copied.
  bool is_slot(int p, const at::Tensor& g) const {
    return g.defined() && g.data_ptr() == views[p].data_ptr() && g.strides() == views[p].strides();
  }

  // First hook of a backward: reset the step and queue the final callback.
  void begin_step_locked() {
    active = true;
    t0 = Clock::now();
    stats = StepStats{};
    stats.step = last.step + 1;
    ready.assign(params.size(), 0);
    arrival.clear();
    pending.assign(plan.size(), 0);
    for (size_t b = 0; b < plan.size(); ++b) pending[b] = static_cast<int>(plan[b].params.size());
    next_launch = 0;
    futures.clear();
    futures.resize(plan.size());
    stats.buckets.assign(plan.size(), {});
    for (size_t b = 0; b < plan.size(); ++b) {
      stats.buckets[b].index = static_cast<int>(b);
      stats.buckets[b].channel = static_cast<int>(b % channels.size());
      stats.buckets[b].bytes = plan[b].numel * c10::elementSize(plan[b].dtype);
    }
    hook_cpu_us = 0;
    profiler->begin_step(stats.step, t0, static_cast<int>(plan.size()));
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_step(); });
    if (!expected_unused.empty()) {
      for (size_t p = 0; p < params.size(); ++p) {
        if (expected_unused[p]) mark_ready_locked(static_cast<int>(p), /*used=*/false);
      }
    }
  }

  void mark_ready_locked(int p, bool used) {
    if (ready[p]) return;
    ready[p] = 1;
    if (used) {
      arrival.push_back(p);
    } else {
      // A locally unused parameter contributes zeros. If its .grad is the
      // slot, zeroing would clobber it (and a globally unused .grad must stay
      // untouched): give it its own copy first.
      auto& g = params[p].mutable_grad();
      if (is_slot(p, g)) g = g.clone();
      views[p].zero_();
    }
    const int b = bucket_of[p];
    if (--pending[b] == 0) stats.buckets[b].ready_us = us_since(t0, Clock::now());
    while (next_launch < static_cast<int>(plan.size()) && pending[next_launch] == 0) {
      launch_locked(next_launch++);
    }
  }

  void launch_locked(int b) {
    hooks::Range range("ddpx::bucket_launch");
    auto& bs = stats.buckets[b];
    bs.launch_us = us_since(t0, Clock::now());
    at::Tensor flat = storage[b];
    const std::string* key = &keys[b];  // keys change only at a re-plan, after every future
    auto* complete = &bs.complete_us;
    const auto start = t0;
    futures[b] = channels[b % channels.size()]->submit(
        [this, flat, key, complete, start, ctx = profiler->launch_context(b)](
            c10d::ProcessGroup& pg) mutable {
          {
            hooks::ReduceScope scope(ctx);
            reduce(flat, *key, pg);
          }
          *complete = us_since(start, Clock::now());
        });
  }

  void on_grad(int p) {
    if (no_sync.load(std::memory_order_relaxed)) return;
    const auto h0 = Clock::now();
    hooks::Range range("ddpx::hook");
    const at::Tensor& g = params[p].grad();
    // The copy needs no lock: slots are disjoint and the plan only changes at
    // the step boundary, after every hook of the step has run.
    if (g.defined() && !is_slot(p, g)) views[p].copy_(g);
    std::lock_guard<std::mutex> lock(mu);
    if (!active) begin_step_locked();
    if (g.defined()) mark_ready_locked(p, /*used=*/true);
    ++stats.hook_calls;
    const auto h1 = Clock::now();
    hook_cpu_us = hook_cpu_us + us_since(h0, h1);
    if (profiler->tracing()) profiler->on_hook(bucket_of[p], h0, h1);
  }

  // Would a plan from the updated prediction launch buckets materially
  // earlier under this step's arrival order than the current plan does?
  bool should_replan() const {
    if (!opts.replan_) return false;
    hooks::OrderPredictor next = predictor;
    next.observe(arrival);
    if (next.stable_steps() < 1) return false;  // this order must have repeated
    const int n = static_cast<int>(params.size());
    const auto candidate = hooks::plan_buckets(
        next.predicted_order(), info, static_cast<int64_t>(opts.first_bucket_mb_ * (1 << 20)),
        static_cast<int64_t>(opts.bucket_cap_mb_ * (1 << 20)));
    return hooks::launch_delay(plan, arrival, n) > hooks::launch_delay(candidate, arrival, n) + 0.02;
  }

  void finish_step();
  void flush_trace() {
    channels[0]->submit([this](c10d::ProcessGroup& pg) { profiler->flush(&pg); }).get();
  }
  void write_back(const std::vector<char>& globally_used);
  void replan_agreed(c10d::ProcessGroup& pg);
};

void GradSync::Impl::finish_step() {
  hooks::Range range("ddpx::final_callback");
  const auto f0 = Clock::now();
  std::vector<std::string> missing;
  {
    std::lock_guard<std::mutex> lock(mu);
    stats.backward_us = us_since(t0, f0);
    for (size_t p = 0; p < params.size(); ++p) {
      if (ready[p]) continue;
      if (opts.unused_ == Unused::Off) {
        missing.push_back(names[p]);
      } else {
        if (!predictor.predicted_unused(static_cast<int>(p))) ++stats.unused_mispredictions;
        mark_ready_locked(static_cast<int>(p), /*used=*/false);
      }
    }
    if (!missing.empty()) {
      active = false;
      // Buckets already launched must finish before the storage is reused.
      for (auto& f : futures) if (f.valid()) f.wait();
      std::string list;
      for (size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", " : "") + missing[i];
      TORCH_CHECK(false, "GradSync: ", missing.size(), " parameter(s) received no gradient in "
                  "this backward (", list, missing.size() > 8 ? ", ..." : "",
                  "); with unused parameters use GradSyncOptions().unused(Unused::Predict) or "
                  "Unused::Exact. The other ranks will time out waiting for this one.");
    }
  }
  // Step-end agreement on channel 0, after every bucket: which parameters
  // were used anywhere (MAX of local flags), and rank 0's re-plan proposal.
  const int n = static_cast<int>(params.size());
  const bool propose = should_replan();
  auto flags = at::zeros({n + 1}, at::kInt);
  {
    auto* f = flags.data_ptr<int>();
    for (int p : arrival) f[p] = 1;
    f[n] = propose && channels[0]->pg().getRank() == 0 ? 1 : 0;  // only rank 0's counts
  }
  auto agree = channels[0]->submit([this, flags](c10d::ProcessGroup& pg) mutable {
    hooks::Range range("ddpx::step_agreement");
    agree_t0 = Clock::now();
    std::vector<at::Tensor> t{flags};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    pg.allreduce(t, o)->wait();
    agree_t1 = Clock::now();
  });
  const auto wait0 = Clock::now();
  const double cpu_before_wait = us_since(f0, wait0);
  std::exception_ptr error;
  hooks::Range wait_range("ddpx::final_wait");
  for (auto& f : futures) {
    try {
      if (f.valid()) f.get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  try {
    agree.get();
  } catch (...) {
    if (!error) error = std::current_exception();
  }
  wait_range.end();
  if (error) {
    std::lock_guard<std::mutex> lock(mu);
    active = false;
    std::rethrow_exception(error);
  }
  const auto w0 = Clock::now();
  std::vector<char> used(n);
  const int* fl = flags.data_ptr<int>();
  for (int p = 0; p < n; ++p) used[p] = fl[p] != 0;
  write_back(used);
  predictor.observe(arrival);
  if (fl[n] != 0) replan_agreed(channels[0]->pg());

  std::lock_guard<std::mutex> lock(mu);
  const auto f1 = Clock::now();
  stats.exposed_comm_us = us_since(f0, f1);
  for (const auto& b : stats.buckets) {
    stats.comm_us += b.complete_us - b.launch_us;
    stats.bytes_reduced += b.bytes;
  }
  // Our CPU: the hooks, the final callback up to its wait, and the write-back.
  stats.hook_cpu_us = hook_cpu_us + cpu_before_wait + us_since(w0, f1);
  stats.replans = replans;
  last = stats;
  profiler->end_step(stats, {t0, f0, wait0, w0, f1, agree_t0, agree_t1}, hook_cpu_us,
                     wire_stats());
  expected_unused.clear();
  active = false;
  if (profiler->flush_due()) flush_trace();  // the first step after the window
}

void GradSync::Impl::write_back(const std::vector<char>& globally_used) {
  at::NoGradGuard no_grad;
  for (size_t p = 0; p < params.size(); ++p) {
    if (!globally_used[p]) continue;  // unused everywhere: .grad untouched, as under DDP
    const int i = static_cast<int>(p);
    auto& g = params[p].mutable_grad();
    if (opts.gradient_as_bucket_view_) {
      // .grad becomes the slot (DDP's gradient_as_bucket_view): the average
      // is already there, and the next backward accumulates into the bucket.
      if (!is_slot(i, g)) g = views[p];
    } else if (g.defined()) {
      g.copy_(views[p]);
    } else {
      g = views[p].clone();
    }
  }
}

void GradSync::Impl::replan_agreed(c10d::ProcessGroup& pg) {
  // Every rank adopts rank 0's predicted order.
  auto order_t = at::empty({static_cast<int64_t>(params.size())}, at::kLong);
  int64_t* o = order_t.data_ptr<int64_t>();
  if (pg.getRank() == 0) {
    auto order = predictor.predicted_order();
    for (size_t i = 0; i < order.size(); ++i) o[i] = order[i];
  }
  std::vector<at::Tensor> t{order_t};
  pg.broadcast(t)->wait();
  std::vector<int> order(o, o + params.size());
  replan(order);
  ++replans;
}

GradSync::GradSync(const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                   comm::ProcessGroupPtr pg, GradSyncOptions options,
                   const torch::OrderedDict<std::string, at::Tensor>& named_buffers) {
  TORCH_CHECK(pg, "GradSync: pg is null");
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::unordered_set<c10::TensorImpl*> seen;  // tied weights appear once
  for (const auto& item : named_parameters) {
    const at::Tensor& t = item.value();
    if (!t.requires_grad() || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
    TORCH_CHECK(t.is_leaf(), "GradSync: parameter '", item.key(), "' is not a leaf tensor");
    names.push_back(item.key());
    params.push_back(t);
  }
  TORCH_CHECK(options.bucket_cap_mb_ > 0 && options.first_bucket_mb_ > 0,
              "GradSync: bucket_cap_mb and first_bucket_mb must be positive");
  impl_ = std::make_unique<Impl>(options, static_cast<int>(params.size()));
  auto& I = *impl_;
  I.names = names;
  I.params = params;
  I.world = pg->getSize();
  I.reduce = hooks::make_reduce_fn(options.codec_, &I.wire_stats);
  I.profiler = std::make_unique<hooks::Profiler>(hooks::TraceConfig::from(options), pg->getRank(),
                                                 pg->getSize(), static_cast<int64_t>(params.size()));
  I.channels.push_back(std::make_unique<hooks::Channel>(pg));
  for (auto& c : options.channels) {
    TORCH_CHECK(c && c->getSize() == pg->getSize() && c->getRank() == pg->getRank(),
                "GradSync: every channel must span the same ranks as pg");
    I.channels.push_back(std::make_unique<hooks::Channel>(c));
  }
  hooks::verify_same_parameters(*pg, names, params);
  I.profiler->agree(*pg);
  if (options.broadcast_on_init_) {
    std::vector<at::Tensor> state = params;
    for (const auto& b : named_buffers) state.push_back(b.value());
    hooks::broadcast_from_rank0(*pg, state);
  }
  for (const auto& p : params) I.info.push_back({p.numel(), p.scalar_type(), p.device()});
  I.replan(I.predictor.predicted_order());
  // The hooks outlive GradSync on the parameters' accumulators (autograd has
  // no way to remove one); they reach it through a pointer the destructor
  // clears, so a backward after GradSync is gone is a plain local backward.
  I.alive = std::make_shared<std::atomic<Impl*>>(impl_.get());
  for (size_t i = 0; i < params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params[i]);
    const int idx = static_cast<int>(i);
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [alive = I.alive, idx](const torch::autograd::variable_list& outputs,
                               const torch::autograd::variable_list&) {
          if (Impl* self = alive->load(std::memory_order_acquire)) self->on_grad(idx);
          return outputs;
        }));
    I.accumulators.push_back(std::move(acc));
  }
}

namespace {
torch::OrderedDict<std::string, at::Tensor> jit_named(const torch::jit::Module& m, bool params) {
  torch::OrderedDict<std::string, at::Tensor> out;
  if (params) {
    for (const auto& p : m.named_parameters(/*recurse=*/true)) out.insert(p.name, p.value);
  } else {
    for (const auto& b : m.named_buffers(/*recurse=*/true)) out.insert(b.name, b.value);
  }
  return out;
}
}  // namespace

GradSync::GradSync(const torch::jit::Module& module, comm::ProcessGroupPtr pg,
                   GradSyncOptions options)
    : GradSync(jit_named(module, true), std::move(pg), std::move(options),
               jit_named(module, false)) {}

GradSync::~GradSync() {
  impl_->alive->store(nullptr, std::memory_order_release);
  auto& P = *impl_->profiler;
  if (!P.needs_flush()) return;
  try {
    // The gather needs every peer here too: not after a failed step or while
    // an exception unwinds (a peer may be gone); rank 0 then writes its own.
    if (!P.step_failed() && std::uncaught_exceptions() == 0) {
      impl_->flush_trace();
    } else {
      P.flush(nullptr);
    }
  } catch (const std::exception& e) {
    TORCH_WARN("GradSync: the trace was not written: ", e.what());
  }
}

void GradSync::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  auto& I = *impl_;
  if (I.opts.unused_ != Unused::Exact) return;
  // Walk the graph from the outputs; accumulators not reached are unused.
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& o : outputs) {
    if (o.defined() && o.grad_fn()) stack.push_back(o.grad_fn().get());
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    for (const auto& e : node->next_edges()) {
      if (e.function) stack.push_back(e.function.get());
    }
  }
  std::lock_guard<std::mutex> lock(I.mu);
  I.expected_unused.assign(I.params.size(), 0);
  for (size_t p = 0; p < I.params.size(); ++p) {
    I.expected_unused[p] = seen.count(I.accumulators[p].get()) ? 0 : 1;
  }
}

GradSync::NoSyncGuard::NoSyncGuard(GradSync& s) : s_(s) { s_.impl_->no_sync = true; }
GradSync::NoSyncGuard::~NoSyncGuard() { s_.impl_->no_sync = false; }

GradSync::State GradSync::state() const {
  const auto& I = *impl_;
  State s;
  for (const auto& b : I.plan) s.plan_order.insert(s.plan_order.end(), b.params.begin(), b.params.end());
  s.predictor = I.predictor.state();
  s.steps = I.predictor.steps_observed();
  return s;
}

void GradSync::load_state(const State& s) {
  auto& I = *impl_;
  const size_t n = I.params.size();
  std::vector<int> order(s.plan_order.begin(), s.plan_order.end());
  std::vector<char> seen(n, 0);
  bool permutation = order.size() == n;
  for (int p : order) {
    permutation = permutation && p >= 0 && static_cast<size_t>(p) < n && !seen[p];
    if (permutation) seen[p] = 1;
  }
  TORCH_CHECK(permutation, "GradSync::load_state: plan_order must be a permutation of the ", n,
              " parameters, got ", s.plan_order.size(), " entries");
  std::lock_guard<std::mutex> lock(I.mu);
  TORCH_CHECK(!I.active, "GradSync::load_state: called during backward");
  I.predictor.load_state(s.predictor, static_cast<int>(s.steps));
  I.replan(order);
}

const StepStats& GradSync::last_step() const { return impl_->last; }

ProfileSummary GradSync::profile() const { return impl_->profiler->summary(); }
std::string GradSync::profile_summary() const { return impl_->profiler->summary_table(); }
void GradSync::flush_trace() {
  if (impl_->profiler->needs_flush()) impl_->flush_trace();
}

struct GradSync::PhaseGuard::State {
  hooks::Profiler& profiler;
  std::string name;
  at::RecordFunction range{at::RecordScope::USER_SCOPE};
  Clock::time_point begin = Clock::now();
};
GradSync::PhaseGuard::PhaseGuard(std::unique_ptr<State> s) : s_(std::move(s)) {}
GradSync::PhaseGuard::PhaseGuard(PhaseGuard&&) noexcept = default;
GradSync::PhaseGuard::~PhaseGuard() {
  if (s_) s_->profiler.phase(s_->name, s_->begin, Clock::now());
}

GradSync::PhaseGuard GradSync::phase(const std::string& name) {
  TORCH_CHECK(!name.empty(), "GradSync::phase: name must not be empty");
  auto s = std::make_unique<PhaseGuard::State>(*impl_->profiler, name);
  if (s->range.isActive()) s->range.before("ddpx::" + name);
  s->begin = Clock::now();
  return PhaseGuard(std::move(s));
}
int64_t GradSync::replans() const { return impl_->replans; }

std::vector<std::vector<std::string>> GradSync::bucket_plan() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& b : impl_->plan) {
    out.emplace_back();
    for (int p : b.params) out.back().push_back(impl_->names[p]);
  }
  return out;
}

}  // namespace ddpx
