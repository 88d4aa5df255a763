// none: a SUM allreduce in the input's own dtype, then a division. The exact
// reference the lossy codecs are measured against.
#include <ATen/ATen.h>

#include "plugin/comm/codec_util.h"

namespace ddpx::comm::detail {
namespace {

class NoneCodec final : public Codec {
 public:
  std::string spec() const override { return "none"; }

  at::Tensor allreduce_mean(const at::Tensor& input, const std::string& key,
                            c10d::ProcessGroup& pg) override {
    check_input(input, spec());
    int64_t bytes = check_agreement(pg, input, spec(), key);
    at::Tensor out = input.contiguous().clone();
    if (out.numel() > 0) {
      bytes += allreduce_sum(pg, out);
      out.div_(pg.getSize());
    }
    count_call(bytes, input.numel());
    return out;
  }
};

const bool registered_none = register_codec(
    {"none", "none               plain allreduce in the input's dtype",
     [](const std::optional<std::string>& arg) -> std::unique_ptr<Codec> {
       TORCH_CHECK(!arg.has_value(), "ddpx codec 'none' takes no argument, got 'none:", *arg, "'\n",
                   codec_grammar());
       return std::make_unique<NoneCodec>();
     }});

}  // namespace
}  // namespace ddpx::comm::detail
