// ddpx_mpi: all-reduce of a sparse COO tensor, as ProcessGroupGloo's
// allreduce_sparse (SUM only; the result, coalesced, replaces the tensor).
//
// Steps (worker side):
//   1. coalesce the local tensor; agree on dtype, sparse/dense dims and sizes;
//   2. all-gather every rank's nnz;
//   3. all-gather-v the indices ([sparse_dim, nnz] each) and the values
//      ([nnz, dense sizes...] each);
//   4. sum the ranks' tensors and coalesce.
#include <numeric>

#include "plugin/comm/mpi_backend.h"
#include "plugin/comm/mpi_env.h"
#include "plugin/comm/mpi_types.h"
#include "plugin/comm/mpi_util.h"

namespace ddpx::comm::detail {
namespace {

// Gathers a different number of elements from each rank; `counts[r]` from
// rank r, in rank order into `recv`.
void allgatherv(MPI_Comm comm, const at::Tensor& send, at::Tensor& recv,
                const std::vector<int64_t>& counts, MPI_Datatype dt, const char* what) {
  std::vector<int> c(counts.size()), d(counts.size(), 0);
  for (size_t r = 0; r < counts.size(); ++r) {
    c[r] = to_count(counts[r], what);
    if (r > 0) d[r] = to_count(int64_t{d[r - 1]} + c[r - 1], what);
  }
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  recv = at::empty({total}, send.options());
  if (total == 0) return;
  const at::Tensor ca = int_array(c);
  const at::Tensor da = int_array(d);
  MPI_Request req = MPI_REQUEST_NULL;
  DDPX_MPI_CHECK(MPI_Iallgatherv(send.data_ptr(), to_count(send.numel(), what), dt, recv.data_ptr(),
                                 ints(ca), ints(da), dt, comm, &req));
  await_request(req, {send, recv, ca, da});
}

}  // namespace

c10::intrusive_ptr<c10d::Work> MpiBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(tensors.size() == 1,
              "ddpx_mpi: allreduce_sparse: tensors must hold exactly one "
              "tensor, got ",
              tensors.size());
  const at::Tensor t = tensors[0];
  TORCH_CHECK(t.defined() && t.layout() == at::kSparse,
              "ddpx_mpi: allreduce_sparse: tensors[0] must be a sparse COO tensor, got layout ",
              t.defined() ? c10::str(t.layout()) : std::string("undefined"));
  TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM,
              "ddpx_mpi: allreduce_sparse supports only ReduceOp.SUM (as Gloo), got ",
              static_cast<int>(opts.reduceOp.op_));
  MPI_Datatype dt = mpi_datatype(t.scalar_type(), "tensors[0]");
  return post(c10d::OpType::_ALLREDUCE_SPARSE, tensors, tensors, [=, this](MpiWorker::Progress&) {
    const at::Tensor local = t.cpu().coalesce();
    const int64_t sparse_dim = local.sparse_dim();
    std::vector<int64_t> shape_id{static_cast<int64_t>(local.scalar_type()), sparse_dim,
                                  local.dense_dim()};
    for (int64_t s : local.sizes()) shape_id.push_back(s);
    uint64_t h = 1469598103934665603ULL;  // FNV-1a: the same tensor shape on every rank
    for (int64_t v : shape_id) {
      h ^= static_cast<uint64_t>(v);
      h *= 1099511628211ULL;
    }
    check_agreement(comm_, {31, static_cast<int64_t>(h >> 1)}, "allreduce_sparse",
                    describe(local) + " sparse, sizes " + c10::str(local.sizes()));

    const at::Tensor nnz = at::tensor({local._nnz()}, at::kLong);
    const at::Tensor all_nnz = at::empty({size_}, at::kLong);
    MPI_Request req = MPI_REQUEST_NULL;
    DDPX_MPI_CHECK(MPI_Iallgather(nnz.data_ptr(), 1, MPI_INT64_T, all_nnz.data_ptr(), 1,
                                  MPI_INT64_T, comm_, &req));
    await_request(req, {nnz, all_nnz});
    const int64_t* n = all_nnz.data_ptr<int64_t>();
    const std::vector<int64_t> nnzs(n, n + size_);

    const at::Tensor values = local._values().contiguous();  // [nnz, dense sizes...]
    int64_t dense_numel = 1;
    for (int64_t d = sparse_dim; d < local.dim(); ++d) dense_numel *= local.size(d);
    std::vector<int64_t> index_counts(size_), value_counts(size_);
    for (int r = 0; r < size_; ++r) {
      index_counts[r] = nnzs[r] * sparse_dim;
      value_counts[r] = nnzs[r] * dense_numel;
    }
    // Indices travel transposed ([nnz, sparse_dim]) so each rank's block is
    // contiguous in the gathered buffer whatever its nnz.
    const at::Tensor idx = local._indices().t().contiguous();
    at::Tensor all_idx, all_val;
    allgatherv(comm_, idx, all_idx, index_counts, MPI_INT64_T, "allreduce_sparse indices");
    allgatherv(comm_, values, all_val, value_counts, dt, "allreduce_sparse values");

    const int64_t total = std::accumulate(nnzs.begin(), nnzs.end(), int64_t{0});
    std::vector<int64_t> value_shape{total};
    for (int64_t d = sparse_dim; d < local.dim(); ++d) value_shape.push_back(local.size(d));
    at::Tensor sum =
        at::sparse_coo_tensor(all_idx.view({total, sparse_dim}).t(), all_val.view(value_shape),
                              local.sizes(), local.options())
            .coalesce();  // duplicates (the same index on several ranks) add up
    t.copy_(sum.to(t.device()));
  });
}

}  // namespace ddpx::comm::detail
