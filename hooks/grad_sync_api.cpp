// GradSync: construction (verify, broadcast, plan, hooks) and the public
// methods. The step protocol is in grad_sync.h.
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/jit/api/module.h>

#include <algorithm>
#include <exception>
#include <numeric>
#include <unordered_set>

#include "hooks/grad_sync_impl.h"
#include "hooks/grad_sync_setup.h"

namespace ddpx {

using hooks::Clock;
using hooks::us_since;

GradSync::GradSync(const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                   comm::ProcessGroupPtr pg, GradSyncOptions options,
                   const torch::OrderedDict<std::string, at::Tensor>& named_buffers) {
  TORCH_CHECK(pg, "GradSync: pg is null");
  // Every parameter is verified across ranks and broadcast from rank 0, the
  // frozen ones too (as DDP does): ranks that initialise a frozen layer
  // differently would otherwise each compute another function while their
  // gradients are averaged as if they did not. Only trainable parameters get
  // hooks and buckets.
  std::vector<std::string> names, all_names;
  std::vector<at::Tensor> params, all_params;
  std::unordered_set<c10::TensorImpl*> seen;  // tied weights appear once
  for (const auto& item : named_parameters) {
    const at::Tensor& t = item.value();
    if (!t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
    all_names.push_back(item.key());
    all_params.push_back(t);
    if (!t.requires_grad()) continue;
    TORCH_CHECK(t.is_leaf(), "GradSync: parameter '", item.key(), "' is not a leaf tensor");
    names.push_back(item.key());
    params.push_back(t);
  }
  TORCH_CHECK(options.bucket_cap_mb_ > 0 && options.first_bucket_mb_ > 0,
              "GradSync: bucket_cap_mb and first_bucket_mb must be positive");
  hooks::check_shard(options);
  impl_ = std::make_unique<Impl>(options, static_cast<int>(params.size()));
  auto& I = *impl_;
  I.names = names;
  I.params = params;
  I.world = pg->getSize();
  std::vector<std::string> buffer_names;
  for (const auto& b : named_buffers) {
    if (!b.value().defined()) continue;
    buffer_names.push_back(b.key());
    I.buffers.push_back(b.value());
  }
  TORCH_CHECK(options.stage_chunk_bytes_ >= 0, "GradSyncOptions::stage_chunk_bytes must be >= 0, got ",
              options.stage_chunk_bytes_);
  I.reduce = hooks::make_reduce_fn(options.codec_, &I.wire_stats, &I.lossy,
                                   options.stage_chunk_bytes_);
  I.profiler =
      std::make_unique<hooks::Profiler>(hooks::TraceConfig::from(options), pg->getRank(),
                                        pg->getSize(), static_cast<int64_t>(params.size()));
  if (comm::detail::FlightRecorder::get().enabled()) {
    // pg's name (torch's group name; a C++ group may have none) and ranks.
    std::string name;
    try {
      name = pg->getGroupName();
    } catch (const c10::Error&) {
    }
    std::vector<int64_t> ranks(pg->getSize());
    std::iota(ranks.begin(), ranks.end(), 0);
    I.fr_group = comm::detail::FlightRecorder::get().group(
        {(name.empty() ? std::string("default") : name) + ":gradsync", "GradSync buckets", ranks,
         "gradsync"});
  }
  TORCH_CHECK(options.calls_in_flight_ >= 1, "GradSync: calls_in_flight must be at least 1, got ",
              options.calls_in_flight_);
  I.channels.push_back(std::make_unique<hooks::Channel>(pg, options.calls_in_flight_));
  for (auto& c : options.channels) {
    TORCH_CHECK(c && c->getSize() == pg->getSize() && c->getRank() == pg->getRank(),
                "GradSync: every channel must span the same ranks as pg");
    I.channels.push_back(std::make_unique<hooks::Channel>(c, options.calls_in_flight_));
  }
  hooks::require_backends(*pg, options.channels, all_params);
  hooks::verify_same_tensors(*pg, all_names, all_params, hooks::kParameters);
  // Buffers are broadcast: a rank whose buffers differ must fail here, by
  // name, not inside the broadcast.
  if (options.broadcast_on_init_ || options.broadcast_buffers_) {
    hooks::verify_same_tensors(*pg, buffer_names, I.buffers, hooks::kBuffers);
  }
  I.profiler->agree(*pg);
  if (options.broadcast_on_init_) {
    std::vector<at::Tensor> state = all_params;
    state.insert(state.end(), I.buffers.begin(), I.buffers.end());
    hooks::broadcast_from_rank0(*pg, state);
  }
  hooks::check_mixed_precision(options, names, params);
  if (options.param_dtype_ && *options.param_dtype_ != at::kFloat) {
    // After the broadcast: the masters are rank 0's float32 values. Before
    // the hooks: ATen drops the autograd accumulator of a tensor whose dtype
    // changes. Frozen float32 parameters go down too (the forward mixes no
    // dtypes); they have no masters (nothing steps them).
    I.masters = amp::MasterWeights(params, *options.param_dtype_);
    for (const auto& t : all_params) {
      if (t.scalar_type() == at::kFloat) amp::convert_in_place(t, *options.param_dtype_);
    }
  }
  for (const auto& p : params) {
    I.info.push_back({p.numel(), options.reduce_dtype_.value_or(p.scalar_type()), p.device()});
  }
  for (size_t u = 0; u < options.drop_units_.size(); ++u) {
    const std::string& prefix = options.drop_units_[u];
    bool any = false;
    for (size_t p = 0; p < names.size(); ++p) {
      if (names[p].rfind(prefix, 0) != 0 || I.info[p].unit >= 0) continue;
      I.info[p].unit = static_cast<int>(u);  // the first unit that names it
      any = true;
    }
    TORCH_CHECK(any, "GradSync: drop_units names '", prefix,
                "', which is the prefix of no parameter that requires grad (or only of "
                "parameters an earlier unit has)");
  }
  TORCH_CHECK(options.staleness_ == 0 || options.staleness_ == 1, "GradSync: staleness is ",
              options.staleness_, "; it must be 0 (exact) or 1 (each update one step late)");
  TORCH_CHECK(options.clip_grad_norm_ >= 0, "GradSync: clip_grad_norm is ",
              options.clip_grad_norm_, "; it must be > 0 (the largest global norm) or 0 (off)");
  TORCH_CHECK(options.clip_grad_norm_ == 0 || options.staleness_ == 0, "GradSync: "
              "clip_grad_norm with staleness(1) is not supported (the stale update would go "
              "unclipped)");
  TORCH_CHECK(options.stale_warmup_ >= 0, "GradSync: stale_warmup is ", options.stale_warmup_,
              "; it must be >= 0 (synchronous steps before the stale ones)");
  if (options.staleness_ > 0) {
    TORCH_CHECK(options.overlap_ == Overlap::Optimizer, "GradSync: staleness(1) applies each "
                "step's update at the end of the next backward, with the optimizer GradSync "
                "steps: it needs overlap(Overlap::Optimizer)",
                options.overlap_ == Overlap::NextForward
                    ? " (NextForward's gates would have nothing to wait for: the next forward "
                      "runs on the parameters before the update anyway)"
                    : "");
    TORCH_CHECK(options.unused_ != Unused::Exact, "GradSync: staleness(1) does not take "
                "Unused::Exact (use Unused::Predict: the step is exact about unused "
                "parameters anyway, at its end)");
    TORCH_CHECK(options.sparse_params_.empty(), "GradSync: staleness(1) reduces dense "
                "gradients only; sparse_params names '", options.sparse_params_.front(), "'");
    I.worker = std::make_unique<hooks::Channel>(pg);  // a thread; its group is not used
  }
  if (options.shard_ != Shard::None) {
    const char* mode = hooks::shard_name(options.shard_);
    I.shard = hooks::ShardMap(I.info, pg->getSize(), pg->getRank());
    for (size_t p = 0; p < params.size(); ++p) {
      TORCH_CHECK(params[p].is_contiguous(), "GradSync: shard(", mode, "): parameter '",
                  names[p], "' is not contiguous; a rank's part of it must be a flat view");
      const auto [lo, hi] = I.shard.mine(static_cast<int>(p));
      I.shard_views.push_back(lo < hi ? params[p].detach().view(-1).narrow(0, lo, hi - lo)
                                      : at::Tensor());
    }
    // Steps buckets during backward (steps_early); NextForward steps after it.
    if (options.overlap_ != Overlap::NextForward) {
      I.stepper = std::make_unique<hooks::Channel>(pg);  // a thread; its group is not used
    }
  }
  if (options.overlap_ == Overlap::NextForward) {
    std::vector<at::Tensor> gated = params;
    std::vector<std::string> gated_names = names;
    gated.insert(gated.end(), I.buffers.begin(), I.buffers.end());
    gated_names.insert(gated_names.end(), buffer_names.begin(), buffer_names.end());
    I.gates = hooks::Gates::make(gated, gated_names);
    // Per-layer gate waits in the trace ("ddpx::gate_wait <name>").
    I.gates->on_wait([profiler = I.profiler.get(), gated_names](int i, Clock::time_point t0,
                                                                Clock::time_point t1) {
      profiler->phase("gate_wait " + gated_names[i], t0, t1);
    });
    I.worker = std::make_unique<hooks::Channel>(pg);  // a thread; its group is not used
  }
  I.declare_sparse(*pg, options.sparse_params_);
  I.replan(I.order_of(I.predictor), I.late_for(I.predictor));
  // The hooks reach GradSync through a pointer the destructor clears, so a
  // backward that races the destruction is a plain local backward; the
  // destructor then removes them from the accumulators (a trainer that builds
  // GradSync anew, say per phase, must not pile up dead hooks).
  I.alive = std::make_shared<std::atomic<Impl*>>(impl_.get());
  for (size_t i = 0; i < params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params[i]);
    const int idx = static_cast<int>(i);
    auto hook = std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [alive = I.alive, idx](const torch::autograd::variable_list& outputs,
                               const torch::autograd::variable_list&) {
          if (Impl* self = alive->load(std::memory_order_acquire)) self->on_grad(idx);
          return outputs;
        });
    I.hook_keys.push_back(acc->add_post_hook(std::move(hook)));
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

// `o` with the weights of `m`'s submodules whose constant `sparse` is true
// (nn.Embedding and nn.EmbeddingBag keep it among their __constants__) and
// that require grad.
GradSyncOptions with_sparse_modules(const torch::jit::Module& m, GradSyncOptions o) {
  for (const auto& sub : m.named_modules()) {
    const auto& type = sub.value.type();
    if (!type->hasConstant("sparse") || !sub.value.hasattr("weight")) continue;
    const c10::IValue sparse = type->getConstant("sparse");
    const c10::IValue weight = sub.value.attr("weight");
    if (!sparse.isBool() || !sparse.toBool() || !weight.isTensor() ||
        !weight.toTensor().requires_grad()) {
      continue;
    }
    const std::string name = sub.name.empty() ? "weight" : sub.name + ".weight";
    auto& declared = o.sparse_params_;
    if (std::find(declared.begin(), declared.end(), name) == declared.end()) {
      declared.push_back(name);
    }
  }
  return o;
}
}  // namespace

GradSync::GradSync(const torch::jit::Module& module, comm::ProcessGroupPtr pg,
                   GradSyncOptions options)
    : GradSync(jit_named(module, true), std::move(pg),
               with_sparse_modules(module, std::move(options)), jit_named(module, false)) {
  // NextForward: every read of a parameter or buffer in the model's methods
  // waits at its gate (hooks/param_gate.h).
  if (impl_->gates) hooks::insert_gates(module);
}

void GradSync::declare_unused(const std::vector<std::string>& names_or_prefixes) {
  auto& I = *impl_;
  TORCH_CHECK(I.opts.staleness_ == 0, "GradSync: declare_unused does not work with "
              "staleness(1) (the declaration would meet the last step's gradients)");
  I.join();  // (its collective must follow the last step's, on every rank alike)
  TORCH_CHECK(!I.no_sync.load(std::memory_order_relaxed),
              "GradSync: declare_unused applies to a synced backward; call it outside no_sync "
              "(before the backward that reduces)");
  std::lock_guard<std::mutex> lock(I.mu);
  TORCH_CHECK(!I.active, "GradSync: declare_unused must be called between steps, not during "
              "backward");
  TORCH_CHECK(!I.declare_check.valid(), "GradSync: declare_unused was called twice before one "
              "backward; declare the step's whole set in one call");
  const int n = static_cast<int>(I.params.size());
  std::vector<char> d(n, 0);
  for (const auto& s : names_or_prefixes) {
    const auto exact = std::find(I.names.begin(), I.names.end(), s);
    if (exact != I.names.end()) {
      d[exact - I.names.begin()] = 1;
      continue;
    }
    bool any = false;
    for (int p = 0; p < n; ++p) {
      if (!s.empty() && I.names[p].rfind(s, 0) == 0) d[p] = any = true;
    }
    TORCH_CHECK(any, "GradSync: declare_unused names '", s, "', which is neither a parameter "
                "that requires grad nor the prefix of one");
  }
  // What the ranks compare: a hash of the set (FNV-1a over the indices) and
  // whether some declared parameter holds a no_sync gradient here.
  uint64_t h = 1469598103934665603ULL;
  int64_t bad = 0, count = 0;
  for (int p = 0; p < n; ++p) {
    if (!d[p]) continue;
    h = (h ^ static_cast<uint64_t>(p)) * 1099511628211ULL;
    ++count;
    if (I.accumulated[p].load(std::memory_order_relaxed)) bad = 1;
  }
  const int64_t key = static_cast<int64_t>(h >> 2);  // non-negative, so -key fits
  I.declare_msg = at::tensor({key, -key, bad}, at::kLong);
  I.declare_check = I.agree_max(I.declare_msg, "ddpx::declare_unused");
  I.declared = std::move(d);
  I.n_declared = static_cast<int>(count);
}

GradSync::~GradSync() {
  try {
    impl_->drain();  // staleness(1): the last update lands, not lost
  } catch (const std::exception& e) {
    TORCH_WARN("GradSync: the last step failed after its backward returned: ", e.what());
  }
  if (impl_->scaler) detail::ScalerAccess::detach(impl_->scaler);
  // (The last step's write-back and optimizer may still be queued on the
  // caller's streams, reading the buckets freed with impl_.)
  hooks::mark_in_use_here(impl_->storage);
  hooks::mark_in_use_here(impl_->spare_storage);
  impl_->alive->store(nullptr, std::memory_order_release);
  // (As DDP's Reducer does: no backward over these parameters may run
  // concurrently with the destruction.)
  for (size_t i = 0; i < impl_->accumulators.size(); ++i) {
    impl_->accumulators[i]->del_post_hook(impl_->hook_keys[i]);
  }
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
  I.join();
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
  const int n = static_cast<int>(I.params.size());
  std::vector<char> expected(n);
  for (int p = 0; p < n; ++p) expected[p] = seen.count(I.accumulators[p].get()) ? 0 : 1;
  // With late buckets, agree now on which parameters some rank will use, so
  // that late buckets launch during backward, like the rest (a MAX-allreduce
  // of n flags on channel 0, idle between steps). Every rank calls this
  // alike, and under no_sync alike, so the collective matches.
  std::vector<char> early;
  const bool has_late =
      std::any_of(I.plan.begin(), I.plan.end(), [](const hooks::BucketPlan& b) { return b.late; });
  if (has_late && !I.no_sync.load()) {
    auto flags = at::empty({n}, at::kInt);
    int* f = flags.data_ptr<int>();
    // A parameter with no_sync gradients contributes them even if unused now.
    for (int p = 0; p < n; ++p) f[p] = expected[p] && !I.accumulated[p].load() ? 0 : 1;
    I.agree_max(flags, "ddpx::used_agreement").get();
    early.assign(f, f + n);
  }
  std::lock_guard<std::mutex> lock(I.mu);
  TORCH_CHECK(!I.active, "GradSync::prepare_for_backward: called during backward");
  I.expected_unused = std::move(expected);
  I.early_used = std::move(early);
}

GradSync::NoSyncGuard::NoSyncGuard(GradSync& s) : s_(s) {
  // NextForward: micro-batches accumulate into the slots, which the last
  // step's updates must have consumed. (Stale: they go into the set not in
  // flight; the pending update need not land first.)
  if (s_.impl_->gates) s_.synchronize();
  s_.impl_->no_sync = true;
}
GradSync::NoSyncGuard::~NoSyncGuard() { s_.impl_->no_sync = false; }

GradSync::State GradSync::state() const {
  impl_->drain();
  auto& I = *impl_;
  State s;
  for (const auto& b : I.plan)
    s.plan_order.insert(s.plan_order.end(), b.params.begin(), b.params.end());
  s.predictor = I.predictor.state();
  s.steps = I.predictor.steps_observed();
  {
    std::lock_guard<std::mutex> lock(I.mu);
    s.residuals = I.owed_residuals();
  }
  for (const auto& m : I.masters.masters()) s.masters.push_back(m.clone());
  if (I.lossy) {
    s.warm_starts.resize(I.params.size());
    for (auto& [key, qt] : I.lossy->warm_starts()) {
      const int p = I.param_of_part_key(key);
      if (p >= 0) s.warm_starts[p] = std::move(qt);
    }
  }
  return s;
}

void GradSync::load_state(const State& s) {
  auto& I = *impl_;
  I.drain();
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
  TORCH_CHECK(s.residuals.empty() || s.residuals.size() == n, "GradSync::load_state: residuals "
              "must be empty or one per parameter (", n, "), got ", s.residuals.size());
  for (size_t p = 0; p < s.residuals.size(); ++p) {
    const at::Tensor& r = s.residuals[p];
    TORCH_CHECK(!r.defined() || r.numel() == I.info[p].numel, "GradSync::load_state: residual ",
                p, " has ", r.numel(), " elements, its parameter ", I.info[p].numel);
  }
  TORCH_CHECK(s.warm_starts.empty() || s.warm_starts.size() == n, "GradSync::load_state: "
              "warm_starts must be empty or one per parameter (", n, "), got ",
              s.warm_starts.size());
  std::map<std::string, at::Tensor> warm;
  for (size_t p = 0; p < s.warm_starts.size(); ++p) {
    const at::Tensor& q = s.warm_starts[p];
    if (!q.defined()) continue;
    const int64_t rows = I.params[p].dim() >= 2 ? I.params[p].size(0) : 0;
    TORCH_CHECK(q.dim() == 2 && rows > 0 && q.size(1) * rows == I.info[p].numel,
                "GradSync::load_state: warm start ", p, " has shape ", q.sizes(),
                ", not [rank, ", rows > 0 ? I.info[p].numel / rows : 0, "] for its parameter of ",
                "shape ", I.params[p].sizes());
    warm.emplace(I.part_key(static_cast<int>(p)), q.to(I.params[p].device()));
  }
  TORCH_CHECK(s.masters.empty() || I.masters.active(), "GradSync::load_state: the state holds ",
              s.masters.size(), " float32 masters, but this GradSync has none (its "
              "GradSyncOptions::mixed_precision keeps float32 parameters)");
  if (I.lossy) I.lossy->load_warm_starts(warm);
  if (!s.masters.empty()) {
    I.masters.load(s.masters, I.names);
  } else if (I.masters.active()) {
    I.masters.load(I.params, I.names);  // (what the parameters hold, their rounding lost)
  }
  I.predictor.load_state(s.predictor, static_cast<int>(s.steps));
  I.replan(order, I.late_for(I.predictor));
  if (s.residuals.empty()) return;
  // The saved residuals replace whatever this run owed (re-plan: all carries).
  for (size_t p = 0; p < n; ++p) {
    if (I.carry[p].defined()) --I.carries;
    I.carry[p] = at::Tensor();
    // (Nothing owed: no carry, as if none had been saved.)
    if (!s.residuals[p].defined() || !I.lossy || !s.residuals[p].any().item<bool>()) {
      continue;
    }
    I.carry[p] = s.residuals[p].reshape(-1).to(I.params[p].device(), at::kFloat, false, true);
    ++I.carries;
  }
}

const StepStats& GradSync::last_step() const {
  impl_->join();
  return impl_->last;
}

ProfileSummary GradSync::profile() const {
  auto& I = *impl_;
  I.join();
  auto s = I.profiler->summary();
  for (const auto& p : I.params) s.param_bytes += static_cast<double>(p.nbytes());
  if (I.optimizer) s.optimizer_state_bytes = static_cast<double>(I.optimizer->state_bytes());
  s.grad_buffer_bytes = static_cast<double>(I.last_storage_peak);
  return s;
}
std::string GradSync::profile_summary() const { return hooks::format_summary(profile()); }
void GradSync::flush_trace() {
  impl_->join();
  if (impl_->profiler->needs_flush()) impl_->flush_trace();
}

struct GradSync::PhaseGuard::State {
  // Spelled out: clang before 16 has no parenthesised aggregate init (make_unique).
  State(hooks::Profiler& p, std::string n) : profiler(p), name(std::move(n)) {}
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
int64_t GradSync::replans() const {
  impl_->join();
  return impl_->replans;
}

std::vector<std::vector<std::string>> GradSync::bucket_plan() const {
  impl_->join();
  std::vector<std::vector<std::string>> out;
  for (const auto& b : impl_->plan) {
    out.emplace_back();
    for (int p : b.params) out.back().push_back(impl_->names[p]);
  }
  return out;
}

}  // namespace ddpx
