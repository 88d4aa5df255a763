// The torch.save data file parser (ddpx-train --data FILE): any bytes as the
// file, checked for an image model and for a token model (the first byte
// picks which), so both validation paths after the unpickling are reached.
#include <torch/serialize.h>

#include "plugin/trainer/data.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

ddpx::trainer::InputSpec spec_for(uint8_t pick) {
  ddpx::trainer::InputSpec s;
  s.model = "fuzz";
  s.num_classes = 3;
  if (pick & 1) {
    s.kind = "tokens";
    s.doc = {/*vocab=*/50, /*sentences=*/2, /*words=*/3, /*classes=*/3};
  } else {
    s.kind = "image";
    s.image_shape = {1, 2, 2};
  }
  return s;
}

// A valid file for each kind: the mutations start from the real format.
void write_seeds() {
  auto save = [](const std::string& name, const at::Tensor& x, const at::Tensor& tx, uint8_t pick) {
    c10::Dict<std::string, at::Tensor> d;
    d.insert("train_x", x);
    d.insert("train_y", at::tensor({0, 1, 2, 1}, at::kLong));
    d.insert("test_x", tx);
    d.insert("test_y", at::tensor({2, 0}, at::kLong));
    const std::vector<char> bytes = torch::pickle_save(c10::IValue(d));
    ddpx::fuzz::write_seed(name,
                           std::string(1, char(pick)) + std::string(bytes.begin(), bytes.end()));
  };
  save("image_uint8", at::arange(16, at::kByte).view({4, 2, 2}), at::ones({2, 1, 2, 2}, at::kByte),
       0);
  save("image_float", at::rand({4, 1, 2, 2}), at::rand({2, 2, 2}), 0);
  save("tokens", at::randint(50, {4, 2, 3}, at::kLong), at::randint(50, {2, 2, 3}, at::kLong), 1);
}

}  // namespace

// No allowance for large allocations: every length torch's loader would
// trust is bounded by the file first (plugin/archive_check), so one the size
// of a mutated length field is a finding (libFuzzer's default malloc limit).
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (ddpx::fuzz::seed_dir()) {
    write_seeds();
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  ddpx::fuzz::expect_ok_or_error([&] {
    const auto split = ddpx::trainer::parse_saved_dict(reinterpret_cast<const char*>(data + 1),
                                                       size - 1, "fuzz", spec_for(data[0]));
    TORCH_INTERNAL_ASSERT(split.train.inputs.size(0) == split.train.size());
  });
  return 0;
}
