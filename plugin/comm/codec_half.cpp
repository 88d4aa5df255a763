// fp16 / bf16: each rank sends x/world in 16 bits; their sum, added in rank
// order in float32 and rounded to 16 bits once (ordered_sum), is the mean.
// Dividing first keeps the sum of `world` fp16 values inside fp16's range
// (65504) whenever each input is. The rank-order sum, rather than the
// backend's SUM allreduce, makes an element's mean independent of where it
// sits in the buffer on any number of ranks: a GradSync run repeats bit for
// bit whatever its bucket plan. Large inputs go in pieces (pipelined in
// codec_util.h): piece k+1 is encoded while piece k is on the wire.
#include <ATen/ATen.h>

#include "plugin/comm/codec_pack.h"
#include "plugin/comm/codec_util.h"

namespace ddpx::comm::detail {

at::Tensor half_pack_ef(const at::Tensor& x, const at::Tensor& e, at::ScalarType wire,
                        int64_t world) {
  const at::Tensor m = e.defined() ? x + e : x;
  at::Tensor q = world == 1 ? m.to(wire) : m.div(world).to(wire);
  // This rank's contribution to the mean is q * world: the rest is residual.
  // Where m or its 16-bit value is inf or NaN (an overflow: x/world beyond
  // float16's 65504), the result says so, and the residual owes nothing:
  // inf - inf would be NaN, and a NaN residual would poison every later call.
  if (e.defined()) {
    at::Tensor e_out = e;
    at::sub_out(e_out, m, q.to(at::kFloat), world);
    e_out.nan_to_num_(0.0, 0.0, 0.0);
  }
  return q;
}

namespace {

class HalfCodec final : public LossyCodec {
 public:
  HalfCodec(std::string name, at::ScalarType wire) : name_(std::move(name)), wire_(wire) {}

  std::string spec() const override { return name_; }

  at::Tensor allreduce_mean(const at::Tensor& input, const std::string& key,
                            c10d::ProcessGroup& pg) override {
    check_input(input, spec());
    int64_t bytes = check_agreement(pg, input, spec(), key);
    if (input.numel() == 0) {
      count_call(bytes, 0);
      return input.contiguous().clone();
    }
    const int64_t n = input.numel();
    const int64_t world = pg.getSize();
    const at::Tensor x = flat_float(input);
    at::Tensor e = residual(key, x);
    at::Tensor out = at::empty({n}, input.options());
    struct Piece {
      int64_t begin, len;
      at::Tensor q;
      OrderedSum sum;
    };
    pipelined(
        n, kPieceElements,
        [&](int64_t b, int64_t len) {
          at::Tensor q = half_pack_ef(
              x.narrow(0, b, len), e.defined() ? e.narrow(0, b, len) : at::Tensor(), wire_, world);
          OrderedSum sum(pg, q, &bytes);
          return Piece{b, len, q, std::move(sum)};
        },
        [&](Piece& p) { out.narrow(0, p.begin, p.len).copy_(p.sum.finish()); });
    count_call(bytes, n);
    return out.view(input.sizes());
  }

  // The same encoding (x + e) / world over all of flat, each owner's run of
  // it sent to the owner, who adds the world's rows in rank order in float32
  // and rounds once: the bits of allreduce_mean's result at its elements.
  bool has_scatter() const override { return true; }
  at::Tensor reduce_scatter_mean_packed(const at::Tensor& flat,
                                        const std::vector<std::vector<int64_t>>& shapes,
                                        const std::vector<Run>& runs, const std::string& key,
                                        c10d::ProcessGroup& pg) override {
    int64_t bytes = 0;
    agree_on_scatter(pg, flat, shapes, runs, spec(), key, &bytes);
    const Run* mine = run_of(runs, pg.getRank());
    const int64_t n = flat.numel();
    at::Tensor out;
    if (n > 0) {
      const at::Tensor x = flat_float(flat);
      const at::Tensor q = half_pack_ef(x, residual(key, x), wire_, pg.getSize());
      std::vector<int64_t> counts(pg.getSize(), 0);
      for (const auto& r : runs) counts[r.rank] = r.numel;
      const at::Tensor rows = scatter_rows(pg, q, counts, mine ? mine->numel : 0, &bytes);
      if (mine) out = add_rows_in_order(rows).to(flat.scalar_type());
    }
    count_call(bytes, n);
    return out;
  }

 private:
  std::string name_;
  at::ScalarType wire_;
};

std::function<std::unique_ptr<Codec>(const std::optional<std::string>&)> factory(
    const char* name, at::ScalarType wire) {
  return [name, wire](const std::optional<std::string>& arg) -> std::unique_ptr<Codec> {
    TORCH_CHECK(!arg.has_value(), "ddpx codec '", name, "' takes no argument, got '", name, ":",
                *arg, "'\n", codec_grammar());
    return std::make_unique<HalfCodec>(name, wire);
  };
}

const bool registered_fp16 =
    register_codec({"fp16", "fp16               x/world in float16, summed in rank order",
                    factory("fp16", at::kHalf)});
const bool registered_bf16 =
    register_codec({"bf16", "bf16               x/world in bfloat16, summed in rank order",
                    factory("bf16", at::kBFloat16)});

}  // namespace
}  // namespace ddpx::comm::detail
