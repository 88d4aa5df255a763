// read_idx's parser (ddpx-train --data DIR): any bytes as an idx file.
#include "plugin/trainer/data.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ddpx::fuzz::expect_ok_or_error([&] {
    const at::Tensor t =
        ddpx::trainer::parse_idx(reinterpret_cast<const char*>(data), size, "fuzz");
    // A parsed file holds exactly the elements its header promised.
    TORCH_INTERNAL_ASSERT(t.dim() >= 1 && t.dim() <= 4);
  });
  return 0;
}
