#include "hooks/grad_sync_setup.h"

#include <ATen/ATen.h>
#include <c10/util/hash.h>
#include <ddpx/codec.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "plugin/comm/work_wait.h"

namespace ddpx::hooks {
namespace {

// One int64 per rank: [size] gathered from every rank.
at::Tensor allgather_stacked(c10d::ProcessGroup& pg, const at::Tensor& mine) {
  std::vector<std::vector<at::Tensor>> out(1);
  for (int i = 0; i < pg.getSize(); ++i) out[0].push_back(at::empty_like(mine));
  std::vector<at::Tensor> in{mine};
  comm::detail::wait_named(pg.allgather(out, in));
  return at::stack(out[0]);
}

std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes() << " " << t.scalar_type();
  return s.str();
}

// Does `pg` take tensors of device type `d`? (NCCL is registered for CPU
// tensors by a spec such as "nccl", and rejects them at the first call.)
bool takes(c10d::ProcessGroup& pg, c10::DeviceType d) {
  // (getDeviceTypes, not hasBackendForDeviceType: 2.11 lacks the latter.)
  const auto types = pg.getDeviceTypes();
  if (std::none_of(types.begin(), types.end(), [d](const c10::Device& t) { return t.type() == d; })) {
    return false;
  }
  return d != c10::DeviceType::CPU || pg.getBackend(d)->getBackendName() != "nccl";
}

}  // namespace

void require_backends(c10d::ProcessGroup& pg,
                      const std::vector<c10::intrusive_ptr<c10d::ProcessGroup>>& channels,
                      const std::vector<at::Tensor>& params) {
  TORCH_CHECK(takes(pg, c10::DeviceType::CPU), "GradSync: process group '", pg.getGroupName(),
              "' has no backend for CPU tensors, which GradSync's step agreements are; give it "
              "one, e.g. ddpx::comm::make(\"cpu:gloo,cuda:nccl\") (what init_from_env() makes "
              "under torchrun)");
  std::vector<c10::DeviceType> types;
  for (const auto& p : params) {
    if (std::find(types.begin(), types.end(), p.device().type()) == types.end()) {
      types.push_back(p.device().type());
    }
  }
  for (size_t c = 0; c <= channels.size(); ++c) {
    c10d::ProcessGroup& g = c == 0 ? pg : *channels[c - 1];
    for (auto d : types) {
      TORCH_CHECK(takes(g, d), "GradSync: ", c == 0 ? "process group '" : "channel '",
                  g.getGroupName(), "' has no backend for ", c10::DeviceTypeName(d),
                  " tensors, and the model has ", c10::DeviceTypeName(d), " parameters");
    }
  }
}

void verify_same_tensors(c10d::ProcessGroup& pg, const std::vector<std::string>& names,
                         const std::vector<at::Tensor>& params, const TensorKind& kind) {
  const int n = pg.getSize();
  const int64_t count = static_cast<int64_t>(params.size());
  auto counts = allgather_stacked(pg, at::full({1}, count, at::kLong));
  for (int r = 0; r < n; ++r) {
    const int64_t c = counts[r][0].item<int64_t>();
    TORCH_CHECK(c == counts[0][0].item<int64_t>(), "GradSync: rank 0 has ",
                counts[0][0].item<int64_t>(), " ", kind.plural, " but rank ", r, " has ", c,
                "; every rank must wrap the same model");
  }
  // Per tensor: a fingerprint of its shape and dtype, then whether it is
  // trainable (a layer frozen on one rank only would train on the others).
  auto fp = at::empty({2 * count}, at::kLong);
  auto* f = fp.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    size_t h = c10::hash_combine(0, static_cast<size_t>(params[i].scalar_type()));
    for (auto s : params[i].sizes()) h = c10::hash_combine(h, static_cast<size_t>(s));
    f[i] = static_cast<int64_t>(h);
    f[count + i] = params[i].requires_grad() ? 1 : 0;
  }
  const auto all = allgather_stacked(pg, fp).contiguous();  // [ranks, 2 * count]
  const int64_t* a = all.data_ptr<int64_t>();
  auto at_rank = [&](int r, int64_t j) { return a[r * 2 * count + j]; };
  for (int64_t i = 0; i < count; ++i) {
    for (int r = 1; r < n; ++r) {
      if (at_rank(r, i) != at_rank(0, i)) {
        TORCH_CHECK(false, "GradSync: ", kind.singular, " '", names[i], "' (index ", i,
                    ") differs between rank 0 and rank ", r, " (this rank ", pg.getRank(), " has ",
                    describe(params[i]),
                    "); every rank must wrap the same model with the same shapes and dtypes");
      }
      const int64_t here = at_rank(0, count + i);
      if (at_rank(r, count + i) != here) {
        TORCH_CHECK(false, "GradSync: ", kind.singular, " '", names[i], "' (index ", i, ") is ",
                    here ? "trainable" : "frozen", " on rank 0 but ", here ? "frozen" : "trainable",
                    " on rank ", r,
                    " (requires_grad differs); freeze the same parameters on every rank");
      }
    }
  }
}

void broadcast_from_rank0(c10d::ProcessGroup& pg, const std::vector<at::Tensor>& tensors) {
  at::NoGradGuard no_grad;
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    if (t.numel() == 0) continue;
    groups[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(t);
  }
  for (auto& [key, ts] : groups) {
    std::vector<at::Tensor> flat_parts;
    for (const auto& t : ts) flat_parts.push_back(t.detach().reshape(-1));
    std::vector<at::Tensor> flat{at::cat(flat_parts)};
    comm::detail::wait_named(pg.broadcast(flat));
    int64_t off = 0;
    for (const auto& t : ts) {
      t.detach().copy_(flat[0].narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
}

void check_mixed_precision(const GradSyncOptions& o, const std::vector<std::string>& names,
                           const std::vector<at::Tensor>& params) {
  if (!o.param_dtype_ && !o.reduce_dtype_) return;
  TORCH_CHECK(o.param_dtype_ && o.reduce_dtype_, "GradSyncOptions::mixed_precision: set both "
              "param_dtype and reduce_dtype (mixed_precision(param_dtype, reduce_dtype))");
  auto low_or_float = [](at::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
  };
  TORCH_CHECK(low_or_float(*o.param_dtype_), "GradSyncOptions::mixed_precision: param_dtype "
              "must be float32, bfloat16 or float16, got ", *o.param_dtype_);
  TORCH_CHECK(low_or_float(*o.reduce_dtype_), "GradSyncOptions::mixed_precision: reduce_dtype "
              "must be float32, bfloat16 or float16, got ", *o.reduce_dtype_);
  TORCH_CHECK(o.staleness_ == 0, "GradSyncOptions: mixed_precision and staleness(1) do not "
              "combine (the stale update swaps .grad for its bucket slot, whose dtype is "
              "reduce_dtype); choose one");
  TORCH_CHECK(o.sparse_params_.empty(), "GradSyncOptions: mixed_precision and sparse_params do "
              "not combine (rows are reduced in the gradient's own dtype); sparse_params names '",
              o.sparse_params_.front(), "' (the torch::jit::Module constructor adds the weights "
              "of Embedding(sparse=True))");
  if (*o.param_dtype_ == at::kFloat) return;
  for (size_t p = 0; p < params.size(); ++p) {
    TORCH_CHECK(params[p].scalar_type() == at::kFloat, "GradSyncOptions::mixed_precision(",
                *o.param_dtype_, ", ", *o.reduce_dtype_, "): parameter '", names[p], "' is ",
                params[p].scalar_type(), "; float32 masters are kept of float32 parameters");
  }
}

const char* shard_name(Shard s) {
  return s == Shard::Optimizer ? "Shard::Optimizer" : "Shard::Gradients";
}

void check_shard(const GradSyncOptions& o) {
  if (o.shard_ == Shard::None) return;
  const char* mode = shard_name(o.shard_);
  TORCH_CHECK(o.codec_ == "none" || comm::make_codec(o.codec_)->has_scatter(), "GradSync: shard(",
              mode, ") with codec('", o.codec_, "'): the codec has no sharded form (its "
              "compression is over whole tensors, which an owner's part may cut); use 'none', "
              "'fp16', 'bf16' or 'int8'");
  TORCH_CHECK(o.staleness_ == 0, "GradSync: shard(", mode, ") with staleness(1) is not "
              "supported (its look-ahead steps every parameter on each rank)");
  TORCH_CHECK(!o.param_dtype_ && !o.reduce_dtype_, "GradSync: shard(", mode,
              ") with mixed_precision is not supported (the float32 masters are not sharded)");
  TORCH_CHECK(o.sparse_params_.empty(), "GradSync: shard(", mode, ") reduces dense "
              "gradients only; sparse_params names '",
              o.sparse_params_.empty() ? "" : o.sparse_params_.front(), "'");
}

}  // namespace ddpx::hooks
