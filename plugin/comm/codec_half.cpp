// fp16 / bf16: each rank sends x/world in 16 bits; the SUM allreduce of those
// is the mean. Dividing first keeps the sum of `world` fp16 values inside
// fp16's range (65504) whenever each input is.
#include <ATen/ATen.h>

#include "plugin/comm/codec_util.h"

namespace ddpx::comm::detail {
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
    const int64_t world = pg.getSize();
    at::Tensor m = compensated(input, key);  // [numel] float32
    at::Tensor q = m.div(world).to(wire_);
    // This rank's contribution to the mean is q * world: the rest is residual.
    if (!key.empty()) keep_residual(key, m, q.to(at::kFloat).mul_(world));
    bytes += allreduce_sum(pg, q);
    count_call(bytes, input.numel());
    return to_output(q.to(at::kFloat), input);
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

const bool registered_fp16 = register_codec(
    {"fp16", "fp16               x/world in float16, SUM allreduce", factory("fp16", at::kHalf)});
const bool registered_bf16 =
    register_codec({"bf16", "bf16               x/world in bfloat16, SUM allreduce",
                    factory("bf16", at::kBFloat16)});

}  // namespace
}  // namespace ddpx::comm::detail
