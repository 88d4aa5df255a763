#include "hooks/sparse_reduce.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "plugin/comm/wire_span.h"
#include "plugin/comm/work_wait.h"

namespace ddpx::hooks {

namespace {

// Every rank's `t` (the same shape everywhere), in rank order.
std::vector<at::Tensor> allgather(c10d::ProcessGroup& pg, const at::Tensor& t) {
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < pg.getSize(); ++r) out[0].push_back(at::empty_like(t));
  std::vector<at::Tensor> in{t};
  comm::detail::WireScope wire;
  comm::detail::wait_named(pg.allgather(out, in));
  return out[0];
}

}  // namespace

SparseAverage sparse_average(c10d::ProcessGroup& pg, const at::Tensor& local,
                             const at::Tensor& param, int64_t sparse_dim) {
  TORCH_CHECK(sparse_dim >= 1 && sparse_dim <= param.dim(), "sparse_average: sparse_dim ",
              sparse_dim, " for a parameter of ", param.dim(), " dimensions");
  const int world = pg.getSize();
  at::Tensor g;
  if (local.defined()) {
    TORCH_CHECK(local.sizes() == param.sizes(), "sparse_average: a gradient of shape ",
                local.sizes(), " for a parameter of shape ", param.sizes());
    // Rows of the split the other ranks use (a rank erring alone here
    // would leave them waiting in the gather).
    g = !local.is_sparse()                 ? local.to_sparse(sparse_dim)
        : local.sparse_dim() != sparse_dim ? local.to_dense().to_sparse(sparse_dim)
                                           : local;
    g = g.coalesce();  // duplicate rows summed here, not sent twice
  }
  // Row counts first (-1: no gradient here), so that every rank sizes the
  // gather alike and takes the same path.
  const auto dev = param.device();
  const auto counts_here =
      at::full({1}, g.defined() ? g._nnz() : -1, at::TensorOptions().dtype(at::kLong).device(dev));
  const auto counts = at::cat(allgather(pg, counts_here)).cpu();
  const int64_t* c = counts.const_data_ptr<int64_t>();
  SparseAverage out;
  out.wire_bytes = 8;
  int64_t most = -1;
  for (int r = 0; r < world; ++r) most = std::max(most, c[r]);
  if (most < 0) return out;  // no rank had a gradient: .grad stays untouched
  const auto sizes = param.sizes();
  std::vector<int64_t> row_shape(sizes.begin() + sparse_dim, sizes.end());
  int64_t row = 1;
  for (int64_t s : row_shape) row *= s;
  const int64_t row_bytes = row * static_cast<int64_t>(param.element_size()) + 8 * sparse_dim;
  const int64_t dense_bytes = param.numel() * static_cast<int64_t>(param.element_size());
  // Per rank, a ring all-gather sends (world-1) * most rows, a ring
  // all-reduce 2 (world-1) / world of the table.
  const bool floating = at::isFloatingType(param.scalar_type());
  if (world * most * row_bytes >= 2 * dense_bytes) {
    auto dense = at::zeros(sizes, param.options());
    if (g.defined()) dense.add_(g);
    if (floating && world > 1) dense.div_(world);  // as the dense buckets: divide, then sum
    std::vector<at::Tensor> t{dense};
    {
      comm::detail::WireScope wire;
      comm::detail::wait_named(pg.allreduce(t));
    }
    out.avg = dense.to_sparse(sparse_dim);
    out.wire_bytes += dense_bytes;
    return out;
  }
  // Rows padded to the most any rank has; each rank keeps its own count.
  auto idx = at::zeros({sparse_dim, most}, param.options().dtype(at::kLong));
  row_shape.insert(row_shape.begin(), most);
  auto val = at::zeros(row_shape, param.options());
  const int64_t mine = g.defined() ? g._nnz() : 0;
  if (mine > 0) {
    idx.narrow(1, 0, mine).copy_(g._indices());
    val.narrow(0, 0, mine).copy_(g._values());
    if (floating && world > 1) val.narrow(0, 0, mine).div_(world);
  }
  const auto idxs = allgather(pg, idx);
  const auto vals = allgather(pg, val);
  out.wire_bytes += most * row_bytes;
  std::vector<at::Tensor> idx_parts, val_parts;
  for (int r = 0; r < world; ++r) {
    if (c[r] <= 0) continue;
    idx_parts.push_back(idxs[r].narrow(1, 0, c[r]));
    val_parts.push_back(vals[r].narrow(0, 0, c[r]));
  }
  if (idx_parts.empty()) {  // used, but no rows anywhere: an all-zero gradient
    idx_parts.push_back(idx.narrow(1, 0, 0));
    val_parts.push_back(val.narrow(0, 0, 0));
  }
  // Rank order, then coalesce: every rank sums the same rows in the same order.
  out.avg = at::sparse_coo_tensor(at::cat(idx_parts, 1), at::cat(val_parts, 0), sizes,
                                  param.options().layout(at::kSparse))
                .coalesce();
  return out;
}

}  // namespace ddpx::hooks
