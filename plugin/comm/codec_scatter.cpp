// The sharded form of the codecs (Codec::reduce_scatter_mean_packed): the
// door and agreement every codec's form shares, and the one all-to-all that
// moves each rank's encoded runs to their owners. What a codec encodes and
// how the owner decodes is the codec's own (codec_half.cpp, codec_int8.cpp).
//
// Why one all-to-all and not a reduce per run (what GradSync does for the
// exact "none"): the encoded contributions cannot be summed on the wire
// (16-bit sums would round at every step of the backend's order; int8 codes
// carry per-rank scales), so the owner must receive every rank's own run --
// the bytes of a reduce-scatter, in one collective whatever the world size.
#include <ATen/ATen.h>

#include <string>

#include "plugin/comm/codec_util.h"
#include "plugin/comm/wire_span.h"
#include "plugin/comm/work_wait.h"

namespace ddpx::comm {

at::Tensor Codec::reduce_scatter_mean_packed(const at::Tensor& /*flat*/,
                                             const std::vector<std::vector<int64_t>>& /*shapes*/,
                                             const std::vector<Run>& /*runs*/,
                                             const std::string& /*key*/,
                                             c10d::ProcessGroup& /*pg*/) {
  TORCH_CHECK(false, "ddpx codec '", spec(), "' has no reduce-scatter (sharded) form: its "
              "compression is over whole tensors, which an owner's run may cut; fp16, bf16 "
              "and int8 have one");
}

namespace detail {

std::vector<int64_t> agree_on_scatter(c10d::ProcessGroup& pg, const at::Tensor& flat,
                                      const std::vector<std::vector<int64_t>>& shapes,
                                      const std::vector<Codec::Run>& runs,
                                      const std::string& spec, const std::string& key,
                                      int64_t* bytes) {
  TORCH_CHECK(flat.is_contiguous(), "ddpx codec '", spec, "': a packed input must be contiguous");
  std::string layout = "runs:";
  int64_t at = 0;
  int last = -1;
  for (const auto& r : runs) {
    TORCH_CHECK(r.offset == at && r.numel >= 0, "ddpx codec '", spec, "': runs must tile the ",
                flat.numel(), " elements in order; a run at ", r.offset, " of ", r.numel,
                " elements follows the end ", at);
    TORCH_CHECK(r.rank > last && r.rank < pg.getSize(), "ddpx codec '", spec, "': the runs' "
                "ranks must ascend strictly within [0, ", pg.getSize(), "), got rank ", r.rank,
                " after ", last);
    at += r.numel;
    last = r.rank;
    layout += std::to_string(r.numel) + "@" + std::to_string(r.rank) + ",";
  }
  TORCH_CHECK(at == flat.numel(), "ddpx codec '", spec, "': the runs hold ", at,
              " elements but the packed input has ", flat.numel());
  return agree_on_part_numels(pg, flat, shapes, spec, key, bytes, layout);
}

const Codec::Run* run_of(const std::vector<Codec::Run>& runs, int rank) {
  for (const auto& r : runs) {
    if (r.rank == rank) return &r;
  }
  return nullptr;
}

at::Tensor scatter_rows(c10d::ProcessGroup& pg, const at::Tensor& send,
                        const std::vector<int64_t>& counts, int64_t each, int64_t* bytes) {
  TORCH_INTERNAL_ASSERT(send.dim() == 1 && send.is_contiguous());
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(counts.size()) == pg.getSize());
  const int64_t w = pg.getSize();
  at::Tensor rows = at::empty({w, each}, send.options());
  at::Tensor in = send;  // (alltoall_base takes its tensors by reference)
  at::Tensor out = rows.view({-1});
  std::vector<int64_t> in_splits = counts, out_splits(w, each);
  *bytes += static_cast<int64_t>(send.nbytes());
  WireScope wire;
  detail::wait_named(pg.alltoall_base(out, in, out_splits, in_splits, c10d::AllToAllOptions{}));
  return rows;
}

}  // namespace detail
}  // namespace ddpx::comm
