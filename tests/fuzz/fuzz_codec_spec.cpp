// Codec specs (GradSyncOptions::codec, ddpx-train --codec, the op's codec
// argument): any text through make_codec and MessageCodec::parse. A spec that
// parses must have a canonical spelling that parses to itself.
#include <ddpx/codec.h>

#include "plugin/comm/codec_message.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string spec(reinterpret_cast<const char*>(data), size);
  ddpx::fuzz::expect_ok_or_error([&] {
    const std::string canon = ddpx::comm::make_codec(spec)->spec();
    TORCH_INTERNAL_ASSERT(ddpx::comm::make_codec(canon)->spec() == canon, "'", spec, "' -> '",
                          canon, "' is not canonical");
  });
  ddpx::fuzz::expect_ok_or_error([&] {
    const auto m = ddpx::comm::MessageCodec::parse(spec);
    const auto again = ddpx::comm::MessageCodec::parse(m.spec());
    TORCH_INTERNAL_ASSERT(again.spec() == m.spec(), "'", spec, "' -> '", m.spec(), "'");
    // The header form a push carries must come back as the same codec.
    const auto wire =
        ddpx::comm::MessageCodec::from_wire(static_cast<int32_t>(m.id), m.chunk, m.ratio);
    TORCH_INTERNAL_ASSERT(wire.spec() == m.spec());
  });
  return 0;
}
