// SUMs over the ranks whose every element is added in rank order, in
// float32: ((x_0 + x_1) + x_2) + ... whatever the element's place in its
// buffer, the buffer's size or the backend. A SUM-allreduce does not
// promise that beyond two ranks: Gloo's ring and Open MPI's segmented
// algorithms add in an order that follows the element's chunk of the buffer,
// so a tensor's sum would change with what it was packed with (the bucket
// plan). Two algorithms, chosen by size, give the same bits:
//   gather   all-gather every rank's tensor, add the rows. One collective;
//            each rank receives (world - 1) times the tensor.
//   scatter  all-to-all: rank j receives every rank's slice j (a reduce-
//            scatter whose adding is ours), adds it in rank order, rounds it
//            to the wire dtype and all-gathers the sums. Two collectives;
//            each rank receives 2 (world - 1) / world of the tensor, an
//            allreduce's bytes.
// The element's sum is the same either way (same operands, same order, same
// float32 accumulation, one rounding to the dtype at the end), so the switch
// between them never shows in a result.
#include <ATen/ATen.h>

#include "plugin/comm/codec_util.h"
#include "plugin/comm/wire_span.h"
#include "plugin/comm/work_wait.h"

namespace ddpx::comm::detail {
namespace {

// Below this many elements per rank the second collective's latency costs
// more than the bytes the scatter form saves (tens of us against ~10 KB at
// 1 Gbit/s), and two ranks gain nothing from it.
constexpr int64_t kScatterMinElements = int64_t{1} << 14;

}  // namespace

at::Tensor add_rows_in_order(const at::Tensor& rows) {
  const int64_t w = rows.size(0);
  at::Tensor acc;
  if (rows.scalar_type() == at::kFloat) {
    acc = w > 1 ? at::add(rows[0], rows[1]) : rows[0].clone();
  } else {
    // A half-precision add would round each partial sum; float32 holds it.
    acc = rows[0].to(at::kFloat);
    if (w > 1) acc.add_(rows[1]);
  }
  for (int64_t r = 2; r < w; ++r) acc.add_(rows[r]);
  return acc.scalar_type() == rows.scalar_type() ? acc : acc.to(rows.scalar_type());
}

OrderedSum::OrderedSum(c10d::ProcessGroup& pg, const at::Tensor& flat, int64_t* bytes)
    : pg_(&pg), n_(flat.numel()), bytes_(bytes) {
  TORCH_INTERNAL_ASSERT(flat.dim() == 1 && flat.is_contiguous());
  const int64_t w = pg.getSize();
  if (w == 1) {
    *bytes_ += flat.nbytes();  // (as a one-rank allreduce counts it)
    result_ = flat.clone();
    return;
  }
  if (w < 3 || n_ < kScatterMinElements) {
    work_ = start_allgather_rows(pg, flat, &buf_, bytes_);
    return;
  }
  seg_ = (n_ + w - 1) / w;
  at::Tensor in = flat;
  if (seg_ * w != n_) {  // the last slice short: padded with zeros nobody reads
    in = at::zeros({seg_ * w}, flat.options());
    in.narrow(0, 0, n_).copy_(flat);
  }
  buf_ = at::empty({seg_ * w}, flat.options());
  // Equal splits (empty split lists): slice r of every rank goes to rank r.
  std::vector<int64_t> equal_splits;
  work_ = pg.alltoall_base(buf_, in, equal_splits, equal_splits, c10d::AllToAllOptions{});
  keep_ = in;
  *bytes_ += (w - 1) * seg_ * static_cast<int64_t>(flat.element_size());
}

at::Tensor OrderedSum::finish() {
  if (result_.defined()) return result_;
  detail::wait_named(work_);
  work_.reset();
  keep_ = at::Tensor();
  if (seg_ == 0) {
    result_ = add_rows_in_order(buf_);
  } else {
    const int64_t w = pg_->getSize();
    const at::Tensor mine = add_rows_in_order(buf_.view({w, seg_}));
    at::Tensor sums;
    detail::wait_named(start_allgather_rows(*pg_, mine, &sums, bytes_));
    result_ = sums.view({-1}).narrow(0, 0, n_);
  }
  buf_ = at::Tensor();
  return result_;
}

at::Tensor ordered_sum(c10d::ProcessGroup& pg, const at::Tensor& flat, int64_t* bytes) {
  WireScope wire;
  return OrderedSum(pg, flat, bytes).finish();
}

}  // namespace ddpx::comm::detail
