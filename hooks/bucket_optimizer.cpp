// The trainer's optimizer stepped per bucket (hooks/bucket_optimizer.h).
#include "hooks/bucket_optimizer.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <unordered_map>

#include "hooks/shard_state.h"

namespace ddpx::hooks {

namespace optim = torch::optim;

BucketOptimizer::BucketOptimizer(optim::Optimizer& user, const std::vector<at::Tensor>& params,
                                 const std::vector<std::string>& names,
                                 const std::vector<at::Tensor>* masters, bool sharded)
    : user_(user),
      params_(params),
      names_(names),
      sharded_(sharded),
      stepped_(masters ? *masters : params),
      group_of_(params.size(), -1) {
  // (AdamW derives from nothing but Optimizer, so the order does not matter.)
  if (dynamic_cast<optim::SGD*>(&user)) {
    kind_ = Kind::SGD;
  } else if (dynamic_cast<optim::AdamW*>(&user)) {
    kind_ = Kind::AdamW;
  } else if (dynamic_cast<optim::Adam*>(&user)) {
    kind_ = Kind::Adam;
  } else {
    TORCH_CHECK(false, "GradSync::set_optimizer: optimizer must be torch::optim::SGD, Adam or "
                "AdamW (their step() is per parameter, so it can run bucket by bucket)");
  }
  std::unordered_map<const c10::TensorImpl*, int> index;
  for (size_t p = 0; p < params.size(); ++p) index[params[p].unsafeGetTensorImpl()] = int(p);
  const auto& groups = user.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t k = 0; k < groups[g].params().size(); ++k) {
      const at::Tensor& t = groups[g].params()[k];
      const auto it = index.find(t.unsafeGetTensorImpl());
      // A frozen tensor (an optimizer over model->parameters() holds them):
      // it never gets a .grad, so optimizer.step() would skip it; so do we.
      if (it == index.end() && !t.requires_grad()) continue;
      TORCH_CHECK(it != index.end(), "GradSync::set_optimizer: parameter ", k, " of param group ",
                  g, " (shape ", t.sizes(), ") is not a parameter GradSync synchronises (one "
                  "that requires grad); GradSync can only step what it averages");
      TORCH_CHECK(group_of_[it->second] < 0, "GradSync::set_optimizer: parameter '",
                  names[it->second], "' is in two param groups");
      group_of_[it->second] = static_cast<int>(g);
    }
  }
  snapshot();
}

const char* BucketOptimizer::kind() const {
  switch (kind_) {
    case Kind::SGD: return "SGD";
    case Kind::Adam: return "Adam";
    case Kind::AdamW: return "AdamW";
  }
  return "?";
}

std::unique_ptr<optim::Optimizer> BucketOptimizer::make(
    std::vector<optim::OptimizerParamGroup> g) {
  switch (kind_) {
    case Kind::SGD:
      return std::make_unique<optim::SGD>(g, optim::SGDOptions(0.0));
    case Kind::Adam:
      return std::make_unique<optim::Adam>(g, optim::AdamOptions());
    case Kind::AdamW:
      return std::make_unique<optim::AdamW>(g, optim::AdamWOptions());
  }
  return nullptr;
}

int64_t BucketOptimizer::state_bytes() const {
  int64_t total = 0, step = 0;
  const auto& state = user_.state();
  for (const auto& p : params_) {
    const auto it = state.find(p.unsafeGetTensorImpl());
    if (it == state.end()) continue;
    for (const auto& field : state_tensors(*it->second, &step)) {
      if (field.second.defined()) total += static_cast<int64_t>(field.second.nbytes());
    }
  }
  return total;
}

void BucketOptimizer::plan(const std::vector<std::vector<int>>& buckets) {
  subs_.clear();
  subs_.resize(buckets.size());
  for (size_t b = 0; b < buckets.size(); ++b) {
    Sub& s = subs_[b];
    for (int p : buckets[b]) {
      const int g = group_of_[p];
      if (g >= 0 && std::find(s.groups.begin(), s.groups.end(), g) == s.groups.end()) {
        s.groups.push_back(g);
      }
    }
    if (s.groups.empty()) continue;
    std::vector<optim::OptimizerParamGroup> groups;
    for (int g : s.groups) groups.emplace_back(std::vector<at::Tensor>{}, snap_[g]->clone());
    s.opt = make(std::move(groups));
  }
}

void BucketOptimizer::snapshot() {
  const auto& groups = user_.param_groups();
  TORCH_CHECK(snap_.empty() || groups.size() == snap_.size(),
              "GradSync: the optimizer given to set_optimizer now has ", groups.size(),
              " param groups, not ", snap_.size(), "; call set_optimizer again after changing it");
  snap_.clear();
  for (const auto& g : groups) snap_.push_back(g.options().clone());
}

namespace {

// `from` copied into `old`'s tensor when that matches, else into a new one.
// The look-ahead copies the state every step: allocating afresh each time,
// pages the size of the optimizer's state fault in every step.
at::Tensor copy_of(const at::Tensor& from, const at::Tensor* old) {
  if (!from.defined()) return from;
  if (old && old->defined() && old->sizes() == from.sizes() && old->dtype() == from.dtype() &&
      old->device() == from.device()) {
    old->copy_(from);
    return *old;
  }
  return from.clone();
}

// Adam's and AdamW's entries have the same fields.
template <class State>
std::unique_ptr<optim::OptimizerParamState> copy_adam(const State& s,
                                                      const optim::OptimizerParamState* old) {
  const auto* o = dynamic_cast<const State*>(old);
  auto c = std::make_unique<State>();
  c->step(s.step());
  c->exp_avg(copy_of(s.exp_avg(), o ? &o->exp_avg() : nullptr));
  c->exp_avg_sq(copy_of(s.exp_avg_sq(), o ? &o->exp_avg_sq() : nullptr));
  c->max_exp_avg_sq(copy_of(s.max_exp_avg_sq(), o ? &o->max_exp_avg_sq() : nullptr));
  return c;
}

// A state entry with its own tensors (OptimizerParamState::clone() shares
// them, and step() updates them in place), reusing those of `old` (an
// earlier copy of the same parameter's entry, or null) where they match.
std::unique_ptr<optim::OptimizerParamState> deep_copy(const optim::OptimizerParamState& st,
                                                      const optim::OptimizerParamState* old) {
  if (const auto* s = dynamic_cast<const optim::SGDParamState*>(&st)) {
    const auto* o = dynamic_cast<const optim::SGDParamState*>(old);
    auto c = std::make_unique<optim::SGDParamState>();
    c->momentum_buffer(copy_of(s->momentum_buffer(), o ? &o->momentum_buffer() : nullptr));
    return c;
  }
  if (const auto* s = dynamic_cast<const optim::AdamParamState*>(&st)) return copy_adam(*s, old);
  if (const auto* s = dynamic_cast<const optim::AdamWParamState*>(&st)) return copy_adam(*s, old);
  TORCH_CHECK(false, "GradSync: unexpected optimizer state entry");
}

}  // namespace

void BucketOptimizer::fit_to_part(optim_state_ptr& st, int p) const {
  const at::Tensor& part = stepped_[p];
  const int64_t n = part.numel(), whole = params_[p].numel();
  const int64_t lo = part.storage_offset() - params_[p].storage_offset();
  auto fit = [&](const at::Tensor& t) {
    if (!t.defined()) return t;
    if (t.numel() == n) return t.dim() == 1 ? t : t.reshape({-1});  // (the whole, shaped)
    TORCH_CHECK(t.numel() == whole, "GradSync: the optimizer's state of '", names_[p], "' has ",
                t.numel(), " elements: neither this rank's part of it (", n, ") nor the whole (",
                whole, "); load a sharded checkpoint with GradSync::load_optimizer_shards");
    return t.reshape(-1).narrow(0, lo, n).clone();
  };
  if (auto* s = dynamic_cast<optim::SGDParamState*>(st.get())) {
    s->momentum_buffer(fit(s->momentum_buffer()));
    return;
  }
  auto adam = [&](auto* a) {
    a->exp_avg(fit(a->exp_avg()));
    a->exp_avg_sq(fit(a->exp_avg_sq()));
    a->max_exp_avg_sq(fit(a->max_exp_avg_sq()));
  };
  if (auto* a = dynamic_cast<optim::AdamParamState*>(st.get())) adam(a);
  if (auto* w = dynamic_cast<optim::AdamWParamState*>(st.get())) adam(w);
}

void BucketOptimizer::step(int b, const std::vector<int>& ps, bool lookahead) {
  std::lock_guard<std::mutex> lock(step_mu_);
  Sub& s = subs_.at(b);
  if (!s.opt) return;
  auto& sub_groups = s.opt->param_groups();
  bool any = false;
  for (size_t i = 0; i < s.groups.size(); ++i) {
    auto& list = sub_groups[i].params();
    list.clear();
    for (int p : ps) {
      if (group_of_[p] == s.groups[i]) list.push_back(stepped_[p]);
    }
    any = any || !list.empty();
    sub_groups[i].set_options(snap_[s.groups[i]]->clone());
  }
  if (!any) return;
  // The state of these parameters moves in for the update and back after,
  // also if step() throws (the trainer's optimizer must keep it). A
  // look-ahead steps copies and drops them. The trainer's key is the
  // parameter, the sub-optimizer's what it steps (a master, or the same).
  auto& mine = s.opt->state();
  auto& theirs = user_.state();
  std::vector<std::pair<void*, void*>> keys;  // (the trainer's, the sub-optimizer's)
  for (int p : ps) {
    void* key = params_[p].unsafeGetTensorImpl();
    void* sub_key = stepped_[p].unsafeGetTensorImpl();
    keys.emplace_back(key, sub_key);
    auto it = theirs.find(key);
    if (it == theirs.end()) continue;
    if (lookahead) {
      const auto kept = scratch_.find(key);
      mine[sub_key] = deep_copy(*it->second, kept == scratch_.end() ? nullptr : kept->second.get());
    } else {
      mine[sub_key] = std::move(it->second);
      theirs.erase(it);
    }
    if (sharded_) fit_to_part(mine[sub_key], p);
  }
  struct GiveBack {
    decltype(mine)& from;
    decltype(theirs)& to;  // the trainer's optimizer, or the look-ahead's copies
    const std::vector<std::pair<void*, void*>>& keys;
    ~GiveBack() {
      for (const auto& [key, sub_key] : keys) {
        auto it = from.find(sub_key);
        if (it != from.end()) to[key] = std::move(it->second);
      }
      from.clear();
    }
  } give_back{mine, lookahead ? scratch_ : theirs, keys};
  s.opt->step();
}

}  // namespace ddpx::hooks
