// The parameter server's messages as a server receives them (plugin/ps/wire):
// any bytes as a push (header, segment lengths, codec payloads, decoded) or
// a note (pull, bye, heartbeat). Input: [mode, source worker, shard
// segments..., 0xFF, message]; the shard is what the receiving server holds
// (up to 4 segments of up to 254 elements), so sizes in the header are
// checked against a shard the input chooses.
#include <ATen/ATen.h>

#include <cstring>

#include "plugin/ps/wire.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace ddpx::ps::detail;

std::string bytes_of(const at::Tensor& t) {
  return std::string(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), t.numel());
}

// A valid push per codec, and a valid note: the mutations start from the
// real format.
void write_seeds() {
  const std::vector<int64_t> shard{5, 17};
  for (const char* spec : {"none", "fp16", "bf16", "int8:4", "topk:0.3"}) {
    const auto codec = ddpx::comm::MessageCodec::parse(spec);
    PushHeader h;
    h.worker = 1;
    h.codec = static_cast<int32_t>(codec.id);
    h.chunk = codec.chunk;
    h.ratio = codec.ratio;
    h.seq = 7;
    std::vector<at::Tensor> payloads;
    for (int64_t n : shard) payloads.push_back(codec.encode(at::randn({n}), at::Tensor()));
    const std::string prefix{'\0', '\1', char(shard[0]), char(shard[1]), char(0xFF)};
    ddpx::fuzz::write_seed(std::string("push_") + (spec[0] == 't' ? "topk" : spec),
                           prefix + bytes_of(pack_push(h, payloads)));
  }
  ddpx::fuzz::write_seed("note_pull",
                         std::string{'\1', '\2', char(0xFF)} + bytes_of(pack_note(kPull, 2, 3)));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (ddpx::fuzz::seed_dir()) {
    write_seeds();
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const uint8_t mode = data[0];
  const int worker = data[1] % 4;
  size_t at = 2;
  std::vector<int64_t> shard;
  while (at < size && data[at] != 0xFF && shard.size() < 4) shard.push_back(data[at++]);
  if (at < size && data[at] == 0xFF) ++at;
  // The received message as the server holds it: a uint8 tensor of its own.
  at::Tensor msg = at::empty({static_cast<int64_t>(size - at)}, at::kByte);
  if (size > at) std::memcpy(msg.data_ptr<uint8_t>(), data + at, size - at);
  ddpx::fuzz::expect_ok_or_error([&] {
    if (mode & 1) {
      const int32_t kinds[] = {kPull, kBye, kHeartbeat};
      parse_note(msg, kinds[(mode >> 1) % 3], worker);
      return;
    }
    const Push p = parse_push(msg, worker, shard);
    TORCH_INTERNAL_ASSERT(p.grads.size() == shard.size());
    for (size_t i = 0; i < shard.size(); ++i) {
      TORCH_INTERNAL_ASSERT(p.grads[i].numel() == shard[i] &&
                            p.grads[i].scalar_type() == at::kFloat);
    }
  });
  return 0;
}
