// ddpx::layer_drop_scales: the drop pattern of ddpx/layer_drop.h as an op, so
// a Python trainer (PyTorch DDP, say) draws exactly the blocks ddpx-train
// does for the same schedule, seed and step.
#include <ddpx/layer_drop.h>
#include <torch/library.h>

#include <ATen/core/PhiloxRNGEngine.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>

namespace ddpx {

double drop_uniform(uint64_t seed, int64_t step, int block, uint64_t stream) {
  // Streams get unrelated keys (splitmix64 of seed and stream); Philox then
  // gives the step its own subsequence and the block its offset in it.
  uint64_t key = seed + 0x9E3779B97F4A7C15ULL * (stream + 1);
  key = (key ^ (key >> 30)) * 0xBF58476D1CE4E5B9ULL;
  key = (key ^ (key >> 27)) * 0x94D049BB133111EBULL;
  key ^= key >> 31;
  at::Philox4_32 engine(key, static_cast<uint64_t>(step), static_cast<uint64_t>(block));
  return static_cast<double>(engine()) * 0x1p-32;
}

double LayerDrop::keep_probability(int64_t step, int block, int depth) const {
  const double depth_frac = static_cast<double>(block + 1) / static_cast<double>(depth);
  switch (schedule) {
    case Schedule::None:
      return 1.0;
    case Schedule::Constant:
      return 1.0 - rate;
    case Schedule::StochasticDepth:
      return 1.0 - depth_frac * rate;
    case Schedule::Progressive: {
      const double theta = (1.0 - rate) * std::exp(-gamma * static_cast<double>(step)) + rate;
      return 1.0 - depth_frac * (1.0 - theta);
    }
  }
  return 1.0;
}

std::vector<double> LayerDrop::scales(int64_t step, int depth, int rank) const {
  std::vector<double> out(depth, 1.0);
  if (!active()) return out;
  const uint64_t stream = per_rank ? static_cast<uint64_t>(rank) + 1 : 0;
  for (int b = 0; b < depth; ++b) {
    const double p = keep_probability(step, b, depth);
    const bool keep = drop_uniform(seed, step, b, stream) < p;
    out[b] = !keep ? 0.0 : rescale ? 1.0 / p : 1.0;
  }
  return out;
}

std::string LayerDrop::describe() const {
  std::ostringstream s;
  switch (schedule) {
    case Schedule::None:
      return "none";
    case Schedule::Constant:
      s << "constant:" << rate;
      break;
    case Schedule::StochasticDepth:
      s << "stochastic-depth:" << rate;
      break;
    case Schedule::Progressive:
      s << "pld:" << rate << " gamma " << gamma;
      break;
  }
  s << (per_rank ? " per-rank" : " shared") << (rescale ? " inverse" : " none") << " seed "
    << seed;
  return s.str();
}

LayerDrop parse_layer_drop(const std::string& spec, double gamma, const std::string& pattern,
                           const std::string& scale, uint64_t seed) {
  LayerDrop d;
  d.seed = seed;
  d.gamma = gamma;
  TORCH_CHECK(pattern == "shared" || pattern == "per-rank",
              "layer drop: --layer-drop-pattern must be shared or per-rank, got '", pattern, "'");
  d.per_rank = pattern == "per-rank";
  TORCH_CHECK(scale == "inverse" || scale == "none",
              "layer drop: --layer-drop-scale must be inverse or none, got '", scale, "'");
  d.rescale = scale == "inverse";
  if (spec == "none") return d;
  const auto colon = spec.find(':');
  const std::string kind = spec.substr(0, colon);
  double value = -1;
  if (colon != std::string::npos) {
    try {
      size_t used = 0;
      value = std::stod(spec.substr(colon + 1), &used);
      if (used != spec.size() - colon - 1) value = -1;
    } catch (const std::exception&) {
      value = -1;
    }
  }
  if (kind == "constant" || kind == "stochastic-depth") {
    TORCH_CHECK(value >= 0 && value < 1, "layer drop: --layer-drop ", spec,
                ": the drop probability after '", kind, ":' must be in [0, 1)");
    d.schedule = kind == "constant" ? LayerDrop::Schedule::Constant
                                    : LayerDrop::Schedule::StochasticDepth;
  } else if (kind == "pld") {
    TORCH_CHECK(value > 0 && value <= 1, "layer drop: --layer-drop ", spec,
                ": theta-bar after 'pld:' (the keep probability the schedule falls to) must be "
                "in (0, 1]");
    TORCH_CHECK(gamma >= 0 && std::isfinite(gamma), "layer drop: --pld-gamma must be >= 0, got ",
                gamma);
    d.schedule = LayerDrop::Schedule::Progressive;
  } else {
    TORCH_CHECK(false, "layer drop: --layer-drop must be none, constant:P, stochastic-depth:P or "
                "pld:THETA, got '", spec, "'");
  }
  d.rate = value;
  return d;
}

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  m.def("layer_drop_scales(str schedule, int step, int depth, int rank=0, int seed=1, "
        "float pld_gamma=0.001, str pattern=\"shared\", str scale=\"inverse\") -> float[]",
        [](const std::string& schedule, int64_t step, int64_t depth, int64_t rank, int64_t seed,
           double pld_gamma, const std::string& pattern, const std::string& scale) {
          TORCH_CHECK(depth >= 0, "layer_drop_scales: depth must be >= 0, got ", depth);
          TORCH_CHECK(step >= 0, "layer_drop_scales: step must be >= 0, got ", step);
          TORCH_CHECK(rank >= 0, "layer_drop_scales: rank must be >= 0, got ", rank);
          return parse_layer_drop(schedule, pld_gamma, pattern, scale,
                                  static_cast<uint64_t>(seed))
              .scales(step, static_cast<int>(depth), static_cast<int>(rank));
        });
}

}  // namespace ddpx
