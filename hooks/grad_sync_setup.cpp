#include "hooks/grad_sync_setup.h"

#include <ATen/ATen.h>
#include <c10/util/hash.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <map>
#include <sstream>

namespace ddpx::hooks {
namespace {

// One int64 per rank: [size] gathered from every rank.
at::Tensor allgather(c10d::ProcessGroup& pg, const at::Tensor& mine) {
  std::vector<std::vector<at::Tensor>> out(1);
  for (int i = 0; i < pg.getSize(); ++i) out[0].push_back(at::empty_like(mine));
  std::vector<at::Tensor> in{mine};
  pg.allgather(out, in)->wait();
  return at::stack(out[0]);
}

std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes() << " " << t.scalar_type();
  return s.str();
}

}  // namespace

void verify_same_parameters(c10d::ProcessGroup& pg, const std::vector<std::string>& names,
                            const std::vector<at::Tensor>& params) {
  const int n = pg.getSize();
  const int64_t count = static_cast<int64_t>(params.size());
  auto counts = allgather(pg, at::full({1}, count, at::kLong));
  for (int r = 0; r < n; ++r) {
    const int64_t c = counts[r][0].item<int64_t>();
    TORCH_CHECK(c == counts[0][0].item<int64_t>(), "GradSync: rank 0 has ",
                counts[0][0].item<int64_t>(), " parameters that require grad but rank ", r,
                " has ", c, "; every rank must wrap the same model");
  }
  // A fingerprint per parameter: its shape and dtype.
  auto fp = at::empty({count}, at::kLong);
  auto* f = fp.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    size_t h = c10::hash_combine(0, static_cast<size_t>(params[i].scalar_type()));
    for (auto s : params[i].sizes()) h = c10::hash_combine(h, static_cast<size_t>(s));
    f[i] = static_cast<int64_t>(h);
  }
  auto all = allgather(pg, fp);  // [ranks, count]
  for (int64_t i = 0; i < count; ++i) {
    for (int r = 1; r < n; ++r) {
      if (all[r][i].item<int64_t>() != all[0][i].item<int64_t>()) {
        TORCH_CHECK(false, "GradSync: parameter '", names[i], "' (index ", i,
                    ") differs between rank 0 and rank ", r, " (this rank ", pg.getRank(),
                    " has ", describe(params[i]),
                    "); every rank must wrap the same model with the same shapes and dtypes");
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
    pg.broadcast(flat)->wait();
    int64_t off = 0;
    for (const auto& t : ts) {
      t.detach().copy_(flat[0].narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
}

}  // namespace ddpx::hooks
