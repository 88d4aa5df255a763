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
#include <ATen/ATen.h>

#include "plugin/comm/codec_util.h"
#include "plugin/comm/work_wait.h"
#include "ops/int8_codec.h"

namespace ddpx::comm::detail {
namespace {

using ddpx::detail::int8_pack;
using ddpx::detail::int8_pack_ef;
using ddpx::detail::int8_unpack_sum_out;

constexpr int64_t kDefaultChunk = 256;

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
      int64_t begin, len;
      at::Tensor msg, rows;
      c10::intrusive_ptr<c10d::Work> work;
    };
    // Whole chunks per piece, so pieces quantise exactly as one message would.
    const int64_t piece = std::max<int64_t>(1, kPieceElements / chunk_) * chunk_;
    pipelined(
        n, piece,
        [&](int64_t b, int64_t len) {
          Piece p{b, len, {}, {}, {}};
          const at::Tensor xp = x.narrow(0, b, len);
          if (e.defined()) {
            at::Tensor ep = e.narrow(0, b, len);
            p.msg = int8_pack_ef(xp, ep, chunk_);
          } else {
            p.msg = int8_pack(xp, chunk_);
          }
          p.work = start_allgather_rows(pg, p.msg, &p.rows, &bytes);
          return p;
        },
        [&](Piece& p) {
          detail::wait_named(p.work);
          at::Tensor dst = sum.narrow(0, p.begin, p.len);
          int8_unpack_sum_out(p.rows, p.len, chunk_, inv_world, dst);
        });
    count_call(bytes, n);
    return to_output(sum, input);
  }

 private:
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
