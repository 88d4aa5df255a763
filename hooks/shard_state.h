#pragma once
// Checkpoints of sharded optimizer state (GradSyncOptions::shard) at any
// world size. A shard is one rank's part of an optimizer's state, as bytes
// (torch::serialize): per parameter, by name, the elements [lo, hi) of the
// flattened parameter it covers and their state (SGD's momentum buffer,
// Adam's and AdamW's moments and step). Loading takes every shard of a
// checkpoint, one at a time, and keeps the elements the loading rank owns
// now: the state re-split by bytes, whatever the world size it was saved
// at. Names, not positions, tie entries to parameters; coverage is checked
// (a shard missing or given twice is an error naming the parameter).
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace ddpx::hooks {

struct ShardedParams {
  const std::vector<std::string>& names;
  const std::vector<at::Tensor>& params;
  // Per parameter: the elements this rank owns, [first, second).
  const std::vector<std::pair<int64_t, int64_t>>& owned;
  // The optimizer steps flat parts (sharded), so its state is flat; else
  // shaped like each parameter.
  bool flat;
};

// `opt`'s state of the parameters (kept under each parameter, the size of
// its owned part, or whole) as rank `rank` of `world`'s shard. `opt` is
// LibTorch's SGD, Adam or AdamW (else an error).
std::string save_shard(torch::optim::Optimizer& opt, const ShardedParams& ps, int world, int rank);

// Replaces `opt`'s state of the parameters by what the `count` shards
// (`shard(k)` gives the k-th's bytes; every rank's of one checkpoint, in
// any order) hold of the elements each owns.
void load_shards(torch::optim::Optimizer& opt, const ShardedParams& ps, int count,
                 const std::function<std::string(int)>& shard);

// A state entry of SGD, Adam or AdamW: its tensors by field name
// (undefined: absent) and, Adam's, its step (else 0).
std::map<std::string, at::Tensor> state_tensors(const torch::optim::OptimizerParamState& st,
                                                int64_t* step);

// "SGD", "Adam" or "AdamW": what `opt` is (else an error naming `who`).
std::string optimizer_kind(torch::optim::Optimizer& opt, const char* who);

}  // namespace ddpx::hooks
