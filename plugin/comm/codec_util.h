#pragma once
// Pieces shared by the codec files: the registry that make_codec parses
// against, the door checks, the cross-rank agreement (step 1 of the protocol
// in ddpx/codec.h), thin synchronous wrappers over c10d collectives, and the
// error-feedback base of the lossy codecs.
#include <ddpx/codec.h>

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "plugin/comm/host_stage.h"
#include "plugin/comm/wire_span.h"

namespace ddpx::comm::detail {

// A codec file registers its name, its grammar line and a factory that gets
// the text after "<name>:" (nullopt when there is none).
struct CodecEntry {
  std::string name;
  std::string grammar;
  std::function<std::unique_ptr<Codec>(const std::optional<std::string>& arg)> make;
};
bool register_codec(CodecEntry entry);

// Parsing helpers for factories: the whole of `arg` must be the number.
double parse_double(const std::string& arg, const std::string& what);
int64_t parse_int(const std::string& arg, const std::string& what);

// Door check of allreduce_mean: a dense floating tensor.
void check_input(const at::Tensor& input, const std::string& spec);

// Door check of allreduce_mean_packed: flat is 1-D and the parts' numels
// (non-negative sizes) add up to its own.
void check_packed(const at::Tensor& flat, const std::vector<std::vector<int64_t>>& shapes,
                  const std::string& spec);

// Step 1 of the protocol; returns the bytes this rank sent. `layout` (the
// parts of a packed call) is agreed on with the shape.
int64_t check_agreement(c10d::ProcessGroup& pg, const at::Tensor& input, const std::string& spec,
                        const std::string& key, const std::string& layout = "");

// check_packed and step 1 for a codec that works per part (int8's chunks,
// top-k's budget): the parts' numels, in order, agreed on by the ranks with
// the rest and `more_layout` (*bytes: what the agreement sent).
std::vector<int64_t> agree_on_part_numels(c10d::ProcessGroup& pg, const at::Tensor& flat,
                                          const std::vector<std::vector<int64_t>>& shapes,
                                          const std::string& spec, const std::string& key,
                                          int64_t* bytes, const std::string& more_layout = "");

// In-place SUM allreduce of a contiguous tensor, waited on; returns bytes sent.
// A device tensor whose backend reduces host memory only
// (stages_through_host) goes through pinned host memory in chunks of
// `stage_chunk_bytes`, their copies pipelined with the wire (host_stage.h;
// counted in the thread's WireSpan); 0 hands the backend the tensor itself.
int64_t allreduce_sum(c10d::ProcessGroup& pg, at::Tensor& t,
                      int64_t stage_chunk_bytes = kStageChunkBytes);

// All-gathers a contiguous 1-D tensor of L elements into [world, L] (row r =
// rank r's tensor), waited on. Adds this rank's payload bytes to *bytes.
at::Tensor allgather_rows(c10d::ProcessGroup& pg, const at::Tensor& flat, int64_t* bytes);

// The SUM over the ranks of a contiguous 1-D tensor, each element added in
// rank order in float32 and rounded once to the tensor's dtype (codec_sum.cpp):
// an element's sum depends on its values only, not on where it sits in
// `flat`, on the number of elements or on the backend's algorithm. A
// SUM-allreduce does not promise that beyond two ranks, so a codec whose
// results must not depend on how tensors were packed (the bucket plan) uses
// this. An allreduce's payload on two ranks and for large tensors (then two
// collectives); a small tensor beyond two ranks is all-gathered (world - 1
// times its bytes received, one collective). Adds this rank's payload bytes
// to *bytes.
at::Tensor ordered_sum(c10d::ProcessGroup& pg, const at::Tensor& flat, int64_t* bytes);

// The same, started now and finished later (a pipelined codec's piece): the
// first collective is launched by the constructor, finish() waits for it and
// does the rest. The caller keeps `flat` alive until finish().
class OrderedSum {
 public:
  OrderedSum(c10d::ProcessGroup& pg, const at::Tensor& flat, int64_t* bytes);
  at::Tensor finish();

 private:
  c10d::ProcessGroup* pg_;
  int64_t n_;
  int64_t* bytes_;
  int64_t seg_ = 0;  // > 0: the scatter form, slices of seg_ elements
  at::Tensor buf_, keep_, result_;
  c10::intrusive_ptr<c10d::Work> work_;
};

// rows [world, L]: their sum in rank order in float32, rounded once to the
// rows' dtype ([L]); the adding of ordered_sum.
at::Tensor add_rows_in_order(const at::Tensor& rows);

// The door of Codec::reduce_scatter_mean_packed: check_packed, `runs`
// tiling flat with strictly ascending ranks of the group, and step 1 of the
// protocol with the parts and the runs agreed on too (*bytes: what the
// agreement sent). Returns the parts' numels, in order.
std::vector<int64_t> agree_on_scatter(c10d::ProcessGroup& pg, const at::Tensor& flat,
                                      const std::vector<std::vector<int64_t>>& shapes,
                                      const std::vector<Codec::Run>& runs,
                                      const std::string& spec, const std::string& key,
                                      int64_t* bytes);

// This rank's run, or null.
const Codec::Run* run_of(const std::vector<Codec::Run>& runs, int rank);

// The all-to-all of a reduce-scatter: `send` (1-D, contiguous) is cut into
// consecutive slices of counts[r] elements, slice r going to rank r; every
// rank sends this rank `each` elements. Returns [world, each] (row r from
// rank r), waited on. Adds send's bytes to *bytes.
at::Tensor scatter_rows(c10d::ProcessGroup& pg, const at::Tensor& send,
                        const std::vector<int64_t>& counts, int64_t each, int64_t* bytes);

// Asynchronous form for pipelining: starts the collective and returns its
// Work; the caller keeps the tensors alive and waits before reading them.
// *rows becomes the [world, L] result buffer.
c10::intrusive_ptr<c10d::Work> start_allgather_rows(c10d::ProcessGroup& pg, const at::Tensor& flat,
                                                    at::Tensor* rows, int64_t* bytes);

// Elements per piece of a pipelined call: 0.25-1 MiB on the wire, a few ms at
// 1 Gbit/s. Long enough that a collective's fixed cost (tens of us) stays
// small, short enough that encoding the next piece and decoding the previous
// one hide behind this one's transfer, and that the per-piece temporaries stay
// in cache and are reused by the allocator instead of being mapped afresh.
constexpr int64_t kPieceElements = int64_t{1} << 18;

// Runs a codec over [0, n) in pieces of `piece` elements with one piece's
// collective in flight while the next is encoded:
//   start(begin, len) -> P   encode the piece and start its collective
//   finish(P&)               wait for it and decode it into the result
// The whole pipeline is one WireScope (first launch to last wait).
template <class Start, class Finish>
void pipelined(int64_t n, int64_t piece, Start&& start, Finish&& finish) {
  using P = decltype(start(int64_t{0}, int64_t{0}));
  std::optional<P> prev;
  std::optional<WireScope> wire;
  for (int64_t b = 0; b < n; b += piece) {
    P cur = start(b, std::min(piece, n - b));
    if (!wire) wire.emplace();
    if (prev) finish(*prev);
    prev.emplace(std::move(cur));
  }
  if (prev) finish(*prev);
}

// input as a flat float32 contiguous tensor: a view when it already is one,
// else a converted copy.
at::Tensor flat_float(const at::Tensor& input);

// Error feedback: a lossy codec encodes m = input + residual (float32, flat);
// what its own contribution c did not carry, m - c, is the next residual.
// Codecs update the residual in place (m is built in its storage), so a step
// allocates no input-sized state.
// Since the result is mean_i(c_i), sum_t result_t = sum_t mean(x_t) - mean(e_T).
class LossyCodec : public Codec {
 protected:
  // The key's persistent residual, [numel] float32 on x's device, zero on its
  // first use, updated in place by the codec; undefined for key "".
  at::Tensor residual(const std::string& key, const at::Tensor& x);
};

// Result in the caller's dtype and shape from a float32 [numel] tensor.
at::Tensor to_output(const at::Tensor& flat, const at::Tensor& input);

}  // namespace ddpx::comm::detail
