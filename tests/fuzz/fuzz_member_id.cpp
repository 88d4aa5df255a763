// ddpx_mpi's cross-rank member ids ("job:world_rank": merge's store entries,
// reconfigure's handles), which other processes send: any bytes, against a
// job name and world size taken from the input's first byte.
#include "plugin/comm/member_id.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int world = 1 + data[0] % 16;
  const std::string id(reinterpret_cast<const char*>(data + 1), size - 1);
  ddpx::fuzz::expect_ok_or_error([&] {
    const int rank = ddpx::comm::detail::parse_member_id(id, "1234@1", world, "fuzz");
    TORCH_INTERNAL_ASSERT(rank >= 0 && rank < world, "'", id, "' -> ", rank);
  });
  return 0;
}
