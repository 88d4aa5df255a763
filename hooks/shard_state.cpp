// Sharded optimizer state in checkpoints (hooks/shard_state.h).
#include "hooks/shard_state.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <map>
#include <optional>
#include <unordered_map>

#include "plugin/archive_check.h"

namespace ddpx::hooks {
namespace optim = torch::optim;
namespace {

constexpr int64_t kFormat = 1;
const char* const kFields[] = {"momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};

template <class State>
std::unique_ptr<optim::OptimizerParamState> adam_entry(int64_t step,
                                                       std::map<std::string, at::Tensor>& f) {
  auto s = std::make_unique<State>();
  s->step(step);
  s->exp_avg(f["exp_avg"]);
  s->exp_avg_sq(f["exp_avg_sq"]);
  s->max_exp_avg_sq(f["max_exp_avg_sq"]);
  return s;
}

std::unique_ptr<optim::OptimizerParamState> make_entry(const std::string& kind, int64_t step,
                                                       std::map<std::string, at::Tensor>& f) {
  if (kind == "SGD") {
    auto s = std::make_unique<optim::SGDParamState>();
    s->momentum_buffer(f["momentum_buffer"]);
    return s;
  }
  if (kind == "Adam") return adam_entry<optim::AdamParamState>(step, f);
  return adam_entry<optim::AdamWParamState>(step, f);
}

}  // namespace

std::map<std::string, at::Tensor> state_tensors(const optim::OptimizerParamState& st,
                                                int64_t* step) {
  *step = 0;
  if (const auto* s = dynamic_cast<const optim::SGDParamState*>(&st)) {
    return {{"momentum_buffer", s->momentum_buffer()}};
  }
  auto adam = [step](const auto& a) -> std::map<std::string, at::Tensor> {
    *step = a.step();
    return {{"exp_avg", a.exp_avg()},
            {"exp_avg_sq", a.exp_avg_sq()},
            {"max_exp_avg_sq", a.max_exp_avg_sq()}};
  };
  if (const auto* a = dynamic_cast<const optim::AdamParamState*>(&st)) return adam(*a);
  if (const auto* w = dynamic_cast<const optim::AdamWParamState*>(&st)) return adam(*w);
  TORCH_CHECK(false, "GradSync: unexpected optimizer state entry");
}

std::string optimizer_kind(optim::Optimizer& opt, const char* who) {
  // (AdamW derives from nothing but Optimizer, so the order does not matter.)
  if (dynamic_cast<optim::SGD*>(&opt)) return "SGD";
  if (dynamic_cast<optim::AdamW*>(&opt)) return "AdamW";
  if (dynamic_cast<optim::Adam*>(&opt)) return "Adam";
  TORCH_CHECK(false, who, ": the optimizer must be torch::optim::SGD, Adam or AdamW");
}

std::string save_shard(optim::Optimizer& opt, const ShardedParams& ps, int world, int rank) {
  const std::string kind = optimizer_kind(opt, "GradSync::optimizer_shard");
  c10::List<std::string> names;
  std::vector<int64_t> ranges, steps;
  std::map<std::string, std::pair<std::vector<int64_t>, c10::List<at::Tensor>>> fields;
  const auto& state = opt.state();
  for (size_t p = 0; p < ps.params.size(); ++p) {
    const auto it = state.find(ps.params[p].unsafeGetTensorImpl());
    if (it == state.end()) continue;
    int64_t step = 0;
    const auto f = state_tensors(*it->second, &step);
    const int64_t entry = static_cast<int64_t>(names.size());
    names.push_back(ps.names[p]);
    ranges.push_back(ps.owned[p].first);
    ranges.push_back(ps.owned[p].second);
    steps.push_back(step);
    for (const auto& [name, t] : f) {
      if (!t.defined()) continue;
      TORCH_CHECK(t.numel() == ps.owned[p].second - ps.owned[p].first, "GradSync: the optimizer's ",
                  name, " of '", ps.names[p], "' has ", t.numel(), " elements, not the ",
                  ps.owned[p].second - ps.owned[p].first,
                  " this rank owns (state not from this "
                  "GradSync's sharded steps?)");
      fields[name].first.push_back(entry);
      fields[name].second.push_back(t.detach().reshape(-1).cpu());
    }
  }
  torch::serialize::OutputArchive ar;
  ar.write("format", c10::IValue(kFormat));
  ar.write("kind", c10::IValue(kind));
  ar.write("of", at::tensor({static_cast<int64_t>(rank), static_cast<int64_t>(world)}, at::kLong));
  ar.write("names", c10::IValue(names));
  ar.write("ranges", at::tensor(ranges, at::kLong).view({-1, 2}));
  ar.write("steps", at::tensor(steps, at::kLong));
  for (auto& [name, f] : fields) {
    ar.write("index." + name, at::tensor(f.first, at::kLong));
    ar.write("state." + name, c10::IValue(f.second));
  }
  std::string bytes;
  ar.save_to([&bytes](const void* data, size_t n) {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  return bytes;
}

void load_shards(optim::Optimizer& opt, const ShardedParams& ps, int count,
                 const std::function<std::string(int)>& shard) {
  const std::string kind = optimizer_kind(opt, "GradSync::load_optimizer_shards");
  std::unordered_map<std::string, int> by_name;
  for (size_t p = 0; p < ps.names.size(); ++p) by_name[ps.names[p]] = static_cast<int>(p);
  struct Acc {
    int64_t covered = 0;
    std::optional<int64_t> step;
    std::map<std::string, at::Tensor> fields;
  };
  std::vector<Acc> acc(ps.params.size());
  std::vector<char> seen(count, 0);  // the ranks of the checkpoint given so far
  for (int k = 0; k < count; ++k) {
    const std::string bytes = shard(k);
    const std::string what =
        "optimizer shard " + std::to_string(k) + " of " + std::to_string(count);
    ddpx::detail::check_torch_archive(bytes.data(), bytes.size(), what.c_str());
    torch::serialize::InputArchive ar;
    ar.load_from(bytes.data(), bytes.size(), at::Device(at::kCPU));
    c10::IValue v;
    ar.read("format", v);
    TORCH_CHECK(v.isInt() && v.toInt() == kFormat, "GradSync: ", what, " has format ", v,
                "; this GradSync reads ", kFormat);
    ar.read("kind", v);
    TORCH_CHECK(v.isString() && v.toStringRef() == kind, "GradSync: ", what,
                " holds the state "
                "of ",
                v.isString() ? v.toStringRef() : "?", ", the optimizer is ", kind);
    at::Tensor of;  // [rank, world]
    ar.read("of", of);
    TORCH_CHECK(of.scalar_type() == at::kLong && of.numel() == 2, "GradSync: ", what,
                " is malformed (of ", of.sizes(), ")");
    const int64_t rank = of[0].item<int64_t>(), world = of[1].item<int64_t>();
    TORCH_CHECK(world == count && rank >= 0 && rank < world && !seen[rank], "GradSync: ", what,
                " is rank ", rank, "'s of a checkpoint by ", world, " ranks",
                world != count ? "; give every rank's shard of it, once each"
                               : " again; give every rank's shard once");
    seen[rank] = 1;
    ar.read("names", v);
    const auto names = v.toList();
    at::Tensor ranges, steps;
    ar.read("ranges", ranges);
    ar.read("steps", steps);
    const int64_t n = static_cast<int64_t>(names.size());
    TORCH_CHECK(ranges.scalar_type() == at::kLong && ranges.dim() == 2 && ranges.size(0) == n &&
                    ranges.size(1) == 2 && steps.scalar_type() == at::kLong && steps.numel() == n,
                "GradSync: ", what, " is malformed (ranges ", ranges.sizes(), ", steps ",
                steps.sizes(), " for ", n, " entries)");
    ranges = ranges.contiguous();
    const int64_t* r = ranges.const_data_ptr<int64_t>();
    std::map<std::string, std::map<int64_t, at::Tensor>> fields;
    for (const char* f : kFields) {
      at::Tensor index;
      if (!ar.try_read(std::string("index.") + f, index)) continue;
      ar.read(std::string("state.") + f, v);
      const auto list = v.toTensorList();
      TORCH_CHECK(
          index.scalar_type() == at::kLong && index.numel() == static_cast<int64_t>(list.size()),
          "GradSync: ", what, " is malformed (", f, ")");
      index = index.contiguous();
      for (size_t i = 0; i < list.size(); ++i)
        fields[f][index.const_data_ptr<int64_t>()[i]] = list.get(i);
    }
    for (int64_t e = 0; e < n; ++e) {
      const std::string& name = names.get(e).toStringRef();
      const auto it = by_name.find(name);
      TORCH_CHECK(it != by_name.end(), "GradSync: ", what, " holds state of '", name,
                  "', which is not a parameter GradSync synchronises");
      const int p = it->second;
      const int64_t olo = r[2 * e], ohi = r[2 * e + 1];
      TORCH_CHECK(0 <= olo && olo <= ohi && ohi <= ps.params[p].numel(), "GradSync: ", what,
                  " covers elements [", olo, ", ", ohi, ") of '", name, "', which has ",
                  ps.params[p].numel());
      const auto [nlo, nhi] = ps.owned[p];
      const int64_t lo = std::max(olo, nlo), hi = std::min(ohi, nhi);
      if (lo >= hi) continue;
      Acc& a = acc[p];
      const int64_t step = steps[e].item<int64_t>();
      TORCH_CHECK(!a.step || *a.step == step,
                  "GradSync: the shards disagree on the step count "
                  "of '",
                  name, "' (", *a.step, " and ", step, ")");
      a.step = step;
      a.covered += hi - lo;
      for (auto& [f, entries] : fields) {
        const auto t = entries.find(e);
        if (t == entries.end()) continue;
        TORCH_CHECK(t->second.numel() == ohi - olo, "GradSync: ", what, "'s ", f, " of '", name,
                    "' has ", t->second.numel(), " elements for a range of ", ohi - olo);
        at::Tensor& dst = a.fields[f];
        if (!dst.defined()) {
          dst = at::zeros({nhi - nlo}, t->second.options().device(ps.params[p].device()));
        }
        dst.narrow(0, lo - nlo, hi - lo).copy_(t->second.narrow(0, lo - olo, hi - lo));
      }
    }
  }
  auto& state = opt.state();
  for (size_t p = 0; p < ps.params.size(); ++p) {
    void* key = ps.params[p].unsafeGetTensorImpl();
    state.erase(key);
    Acc& a = acc[p];
    if (a.covered == 0) continue;  // never stepped: no state, as in a fresh optimizer
    const int64_t want = ps.owned[p].second - ps.owned[p].first;
    TORCH_CHECK(
        a.covered == want, "GradSync: the optimizer shards cover ", a.covered, " of the ", want,
        " elements of '", ps.names[p], "' this rank owns (",
        a.covered < want ? "a shard of the checkpoint is missing" : "a shard was given twice", ")");
    if (!ps.flat) {
      for (auto& [f, t] : a.fields) t = t.view(ps.params[p].sizes());
    }
    state[key] = make_entry(kind, *a.step, a.fields);
  }
}

}  // namespace ddpx::hooks
