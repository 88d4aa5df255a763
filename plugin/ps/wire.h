#pragma once
// The bytes of the parameter server's messages (protocol: ddpx/ps.h). Every
// message starts with a fixed header whose first word says what it is, so a
// server can take any message from any source with one matched probe and
// check it before reading further.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "plugin/comm/codec_message.h"

namespace ddpx::ps::detail {

// MPI tags; the header repeats the kind (a message is checked against both).
enum Tag : int {
  kPush = 1,
  kPull = 2,
  kBye = 3,
  kHeartbeat = 4,
  kFinal = 5,  // server 0 -> worker: the list of dropped workers (Session::share_final)
  kReply = 10,
  kError = 11
};

constexpr int32_t kMagic = 0x64707331;  // "dps1"

// Flags of a push.
constexpr int32_t kAfterPush = 1;  // reply with the parameters that follow this push
constexpr int32_t kDelayComp = 2;  // each payload ends with g * g * w_base, float32 (DC-ASGD)

struct PushHeader {
  int32_t magic = kMagic;
  int32_t kind = kPush;
  int32_t worker = 0;
  int32_t codec = 0;  // comm::WireCodec
  int64_t seq = 0;
  int64_t base = 0;   // version of the receiving server's shard the gradient was computed on
  int64_t chunk = 0;  // int8's argument
  double ratio = 0;   // topk's argument
  int32_t flags = 0;
  int32_t segments = 0;
  double loss = 0, correct = 0, samples = 0;  // the step's, for the servers' metrics
};

// PULL, BYE, HEARTBEAT.
struct Note {
  int32_t magic = kMagic;
  int32_t kind = 0;
  int32_t worker = 0;
  int32_t pad = 0;
  int64_t seq = 0;
};

// Followed by the shard's float32 values (delta 0) or by the session's pull
// codec's message of the difference to what the worker holds (delta 1).
struct ReplyHeader {
  int32_t magic = kMagic;
  int32_t kind = kReply;
  int64_t version = 0;
  int64_t seq = 0;  // the push (or pull) this answers
  int32_t delta = 0;
  int32_t pad = 0;
};
static_assert(sizeof(ReplyHeader) == 32, "the float payload must stay 8-byte aligned");

// [header | int64 length per segment | payloads] as one uint8 tensor.
at::Tensor pack_push(PushHeader h, const std::vector<at::Tensor>& payloads);

struct Push {
  PushHeader header;
  comm::MessageCodec codec;
  std::vector<at::Tensor> grads;  // decoded, [segment numel] float32 each
  std::vector<at::Tensor> comp;   // kDelayComp: g * g * w_base per segment (else empty)
  int64_t bytes = 0;              // of the message
};

// Checks a received push against the receiving shard (segment sizes, in
// order) and the sender, and decodes it; a c10::Error says what is wrong.
Push parse_push(const at::Tensor& msg, int source_worker, const std::vector<int64_t>& seg_numel);

// A Note of `kind`; parse_note checks size, magic, kind and worker.
at::Tensor pack_note(int32_t kind, int32_t worker, int64_t seq);
Note parse_note(const at::Tensor& msg, int32_t kind, int source_worker);

}  // namespace ddpx::ps::detail
