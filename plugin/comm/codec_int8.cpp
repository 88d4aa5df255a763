// int8: per-chunk absmax int8 codes plus float32 scales. Every rank
// all-gathers the world's messages and decodes and sums them itself, so the
// sum is exact over the decoded values and each element carries one
// quantisation error (absmax/254 of its chunk, per rank).
//
// Why all-gather and not reduce-scatter + all-gather: a reduce-scatter of
// int8 codes cannot sum them on the wire (scales differ per rank); the
// alternative alltoall -> decode/sum -> requantise -> all-gather sends
// 2(w-1)/w bytes per element instead of (w-1), the same at w = 2 (the
// benchmark's case) but with two quantisations and two round trips.
// It wins from w = 3 on; that variant is not built yet.
//
// Messages are packed by ddpx::_int8_pack_ef / _int8_unpack_sum (CPU and
// CUDA kernels; layout in kernels/common/int8_codec.h); packing updates the
// error-feedback residual in the same pass. Large inputs go in pieces, each
// its own message (pipelined in codec_util.h): piece k+1 is packed and piece
// k-1 decoded while piece k is on the wire.
//
// Chunks start at each tensor's first element: a packed call (a GradSync
// bucket) chunks every part on its own, and pieces are cut at chunk bounds.
// So what an element becomes on the wire and after decoding depends only on
// its tensor (and its residual), not on which bucket holds the tensor, where
// the bucket was cut or how it was split into pieces: a re-planned run
// repeats bit for bit.
#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "plugin/comm/codec_util.h"
#include "plugin/comm/work_wait.h"
#include "ops/int8_codec.h"

namespace ddpx::comm::detail {
namespace {

using ddpx::detail::int8_pack;
using ddpx::detail::int8_pack_ef;
using ddpx::detail::int8_unpack_sum_out;

constexpr int64_t kDefaultChunk = 256;

// A pipelined piece: [begin, begin + len) of the input, holding whole chunks
// of the parts it overlaps (the numels of their pieces in `parts`).
struct PieceSpan {
  int64_t begin = 0, len = 0;
  std::vector<int64_t> parts;
};

// Cuts parts (numels, in order) into pieces of about `budget` elements at the
// parts' own chunk bounds; a part larger than a piece spans several.
std::vector<PieceSpan> cut_pieces(const std::vector<int64_t>& parts, int64_t chunk,
                                  int64_t budget) {
  std::vector<PieceSpan> out(1);
  int64_t off = 0;
  for (int64_t m : parts) {
    int64_t left = m;
    while (left > 0) {
      PieceSpan* cur = &out.back();
      const int64_t room = budget - cur->len;
      int64_t take = left <= room ? left : room / chunk * chunk;  // whole chunks
      if (take == 0) {
        if (cur->len == 0) {
          take = std::min(left, chunk);  // budget < chunk: one chunk a piece
        } else {
          out.push_back({off + (m - left), 0, {}});
          continue;
        }
      }
      cur->parts.push_back(take);
      cur->len += take;
      left -= take;
    }
    if (m == 0) out.back().parts.push_back(0);  // keeps parts and shapes aligned
    off += m;
  }
  return out;
}

// The chunk parts of elements [begin, end) of a packed input whose tensors
// have `parts` numels: each tensor's elements in the range, on the tensor's
// own chunk grid -- a piece starting inside a chunk first completes it --
// so every chunk but one cut by `begin` is the unsharded message's chunk.
std::vector<int64_t> run_parts(const std::vector<int64_t>& parts, int64_t chunk, int64_t begin,
                               int64_t end) {
  std::vector<int64_t> out;
  int64_t ts = 0;  // the tensor's first element in the input
  for (int64_t m : parts) {
    const int64_t a = std::max(begin, ts), b = std::min(end, ts + m);
    if (a < b) {
      const int64_t into = (a - ts) % chunk;
      const int64_t head = into == 0 ? 0 : std::min(b - a, chunk - into);
      if (head > 0) out.push_back(head);
      if (b - a > head) out.push_back(b - a - head);
    }
    ts += m;
  }
  return out;
}

class Int8Codec final : public LossyCodec {
 public:
  explicit Int8Codec(int64_t chunk) : chunk_(chunk) {}

  std::string spec() const override {
    return chunk_ == kDefaultChunk ? "int8" : "int8:" + std::to_string(chunk_);
  }

  at::Tensor allreduce_mean(const at::Tensor& input, const std::string& key,
                            c10d::ProcessGroup& pg) override {
    check_input(input, spec());
    int64_t bytes = check_agreement(pg, input, spec(), key);
    return reduce(input, {input.numel()}, key, pg, bytes);
  }

  at::Tensor allreduce_mean_packed(const at::Tensor& flat,
                                   const std::vector<std::vector<int64_t>>& shapes,
                                   const std::string& key, c10d::ProcessGroup& pg,
                                   const std::vector<std::string>& /*part_keys*/) override {
    int64_t bytes = 0;  // the chunking follows the parts: agreed on too
    const auto parts = agree_on_part_numels(pg, flat, shapes, spec(), key, &bytes);
    return reduce(flat, parts, key, pg, bytes);
  }

  // Each owner's run packed as its own message (chunks on the tensors' grids,
  // cut at the run's start: run_parts), the messages sent to their owners in
  // one all-to-all; the owner decodes and adds the world's messages in rank
  // order, as allreduce_mean decodes a gathered row set.
  bool has_scatter() const override { return true; }
  at::Tensor reduce_scatter_mean_packed(const at::Tensor& flat,
                                        const std::vector<std::vector<int64_t>>& shapes,
                                        const std::vector<Run>& runs, const std::string& key,
                                        c10d::ProcessGroup& pg) override {
    int64_t bytes = 0;
    const auto parts = agree_on_scatter(pg, flat, shapes, runs, spec(), key, &bytes);
    const Run* mine = run_of(runs, pg.getRank());
    const int64_t n = flat.numel();
    at::Tensor out;
    if (n > 0) {
      const at::Tensor x = flat_float(flat);
      at::Tensor e = residual(key, x);
      std::vector<at::Tensor> msgs;
      std::vector<int64_t> counts(pg.getSize(), 0);
      for (const auto& r : runs) {
        if (r.numel == 0) continue;
        const auto rp = run_parts(parts, chunk_, r.offset, r.offset + r.numel);
        const at::Tensor xr = x.narrow(0, r.offset, r.numel);
        if (e.defined()) {
          at::Tensor er = e.narrow(0, r.offset, r.numel);
          msgs.push_back(int8_pack_ef(xr, er, chunk_, rp));
        } else {
          msgs.push_back(int8_pack(xr, chunk_, rp));
        }
        counts[r.rank] = msgs.back().numel();
      }
      std::vector<int64_t> mine_parts;
      int64_t each = 0;  // the bytes of this rank's run's message, the same from every rank
      if (mine && mine->numel > 0) {
        mine_parts = run_parts(parts, chunk_, mine->offset, mine->offset + mine->numel);
        each = counts[pg.getRank()];
      }
      const at::Tensor send = msgs.size() == 1 ? msgs[0] : at::cat(msgs);
      const at::Tensor rows = scatter_rows(pg, send, counts, each, &bytes);
      if (mine) {
        at::Tensor sum = at::zeros({mine->numel}, flat.options().dtype(at::kFloat));
        if (mine->numel > 0) {
          int8_unpack_sum_out(rows, mine->numel, chunk_, 1.0 / static_cast<double>(pg.getSize()),
                              sum, mine_parts);
        }
        out = sum.to(flat.scalar_type());
      }
    }
    count_call(bytes, n);
    return out;
  }

 private:
  at::Tensor reduce(const at::Tensor& input, const std::vector<int64_t>& parts,
                    const std::string& key, c10d::ProcessGroup& pg, int64_t bytes) {
    if (input.numel() == 0) {
      count_call(bytes, 0);
      return input.contiguous().clone();
    }
    const int64_t n = input.numel();
    const double inv_world = 1.0 / static_cast<double>(pg.getSize());
    const at::Tensor x = flat_float(input);
    at::Tensor e = residual(key, x);
    at::Tensor sum = at::empty({n}, input.options().dtype(at::kFloat));  // the mean, decoded
    struct Piece {
      const PieceSpan* span;
      at::Tensor msg, rows;
      c10::intrusive_ptr<c10d::Work> work;
    };
    // Whole chunks per piece, so pieces quantise exactly as one message would.
    const std::vector<PieceSpan> pieces = cut_pieces(parts, chunk_, kPieceElements);
    pipelined(
        static_cast<int64_t>(pieces.size()), 1,
        [&](int64_t i, int64_t) {
          const PieceSpan& s = pieces[i];
          Piece p{&s, {}, {}, {}};
          const at::Tensor xp = x.narrow(0, s.begin, s.len);
          if (e.defined()) {
            at::Tensor ep = e.narrow(0, s.begin, s.len);
            p.msg = int8_pack_ef(xp, ep, chunk_, s.parts);
          } else {
            p.msg = int8_pack(xp, chunk_, s.parts);
          }
          p.work = start_allgather_rows(pg, p.msg, &p.rows, &bytes);
          return p;
        },
        [&](Piece& p) {
          detail::wait_named(p.work);
          at::Tensor dst = sum.narrow(0, p.span->begin, p.span->len);
          int8_unpack_sum_out(p.rows, p.span->len, chunk_, inv_world, dst, p.span->parts);
        });
    count_call(bytes, n);
    return to_output(sum, input);
  }

  int64_t chunk_;
};

const bool registered_int8 = register_codec(
    {"int8",
     "int8[:<chunk>]     int8 codes + a float32 scale per <chunk> elements (default 256), "
     "all-gathered",
     [](const std::optional<std::string>& arg) -> std::unique_ptr<Codec> {
       int64_t chunk = kDefaultChunk;
       if (arg) chunk = parse_int(*arg, "int8's <chunk>");
       TORCH_CHECK(chunk >= 1 && chunk <= (1 << 20), "ddpx codec: int8's <chunk> must be in [1, ",
                   1 << 20, "], got ", chunk, "\n", codec_grammar());
       return std::make_unique<Int8Codec>(chunk);
     }});

}  // namespace
}  // namespace ddpx::comm::detail
