#include "plugin/ps/wire.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace ddpx::ps::detail {

at::Tensor pack_push(PushHeader h, const std::vector<at::Tensor>& payloads) {
  h.segments = static_cast<int32_t>(payloads.size());
  int64_t bytes = sizeof(PushHeader) + 8 * static_cast<int64_t>(payloads.size());
  for (const auto& p : payloads) bytes += p.numel();
  at::Tensor msg = at::empty({bytes}, at::kByte);
  uint8_t* out = msg.data_ptr<uint8_t>();
  std::memcpy(out, &h, sizeof h);
  auto* lengths = reinterpret_cast<int64_t*>(out + sizeof h);
  uint8_t* body = out + sizeof h + 8 * payloads.size();
  for (size_t i = 0; i < payloads.size(); ++i) {
    TORCH_INTERNAL_ASSERT(payloads[i].scalar_type() == at::kByte && payloads[i].is_contiguous());
    lengths[i] = payloads[i].numel();
    std::memcpy(body, payloads[i].data_ptr<uint8_t>(), payloads[i].numel());
    body += payloads[i].numel();
  }
  return msg;
}

Push parse_push(const at::Tensor& msg, int source_worker, const std::vector<int64_t>& seg_numel) {
  const int64_t size = msg.numel();
  const uint8_t* in = msg.data_ptr<uint8_t>();
  Push p;
  p.bytes = size;
  TORCH_CHECK(size >= static_cast<int64_t>(sizeof(PushHeader)), "ddpx ps: a push of ", size,
              " bytes is shorter than its header (", sizeof(PushHeader), " bytes)");
  std::memcpy(&p.header, in, sizeof(PushHeader));
  const PushHeader& h = p.header;
  TORCH_CHECK(h.magic == kMagic && h.kind == kPush, "ddpx ps: a push from worker ", source_worker,
              " has no push header (magic ", h.magic, ", kind ", h.kind, ")");
  TORCH_CHECK(h.worker == source_worker, "ddpx ps: a push from worker ", source_worker,
              " says it is from worker ", h.worker);
  TORCH_CHECK(h.segments == static_cast<int64_t>(seg_numel.size()), "ddpx ps: a push from worker ",
              source_worker, " has ", h.segments, " segments; this server's shard has ",
              seg_numel.size(), " (do all ranks run the same model?)");
  p.codec = comm::MessageCodec::from_wire(h.codec, h.chunk, h.ratio);
  const int64_t head = sizeof(PushHeader) + 8 * int64_t{h.segments};
  TORCH_CHECK(size >= head, "ddpx ps: a push from worker ", source_worker, " of ", size,
              " bytes is shorter than its header and segment lengths (", head, " bytes)");
  std::vector<int64_t> lengths(h.segments);
  // Not for zero segments: memcpy must not see the empty vector's null pointer.
  if (!lengths.empty()) std::memcpy(lengths.data(), in + sizeof(PushHeader), 8 * lengths.size());
  const bool comp = h.flags & kDelayComp;
  int64_t offset = head;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t want = p.codec.message_bytes(seg_numel[i]) + (comp ? 4 * seg_numel[i] : 0);
    TORCH_CHECK(lengths[i] == want, "ddpx ps: a push from worker ", source_worker, " (seq ", h.seq,
                ", codec ", p.codec.spec(), comp ? ", delay compensation" : "", ") has ", lengths[i],
                " bytes for segment ", i, " of ", seg_numel[i], " elements; expected ", want);
    offset += want;
  }
  TORCH_CHECK(offset == size, "ddpx ps: a push from worker ", source_worker, " (seq ", h.seq,
              ") is ", size, " bytes; its header and lengths add up to ", offset);
  offset = head;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t coded = p.codec.message_bytes(seg_numel[i]);
    p.grads.push_back(p.codec.decode(msg.narrow(0, offset, coded), seg_numel[i]));
    if (comp) {
      p.comp.push_back(msg.narrow(0, offset + coded, 4 * seg_numel[i]).clone().view(at::kFloat));
    }
    offset += lengths[i];
  }
  return p;
}

at::Tensor pack_note(int32_t kind, int32_t worker, int64_t seq) {
  Note n;
  n.kind = kind;
  n.worker = worker;
  n.seq = seq;
  at::Tensor msg = at::empty({static_cast<int64_t>(sizeof n)}, at::kByte);
  std::memcpy(msg.data_ptr<uint8_t>(), &n, sizeof n);
  return msg;
}

Note parse_note(const at::Tensor& msg, int32_t kind, int source_worker) {
  Note n;
  TORCH_CHECK(msg.numel() == static_cast<int64_t>(sizeof n), "ddpx ps: a message of kind ", kind,
              " from worker ", source_worker, " has ", msg.numel(), " bytes; expected ", sizeof n);
  std::memcpy(&n, msg.data_ptr<uint8_t>(), sizeof n);
  TORCH_CHECK(n.magic == kMagic && n.kind == kind && n.worker == source_worker,
              "ddpx ps: a message from worker ", source_worker, " has a bad header (magic ",
              n.magic, ", kind ", n.kind, ", worker ", n.worker, ")");
  return n;
}

}  // namespace ddpx::ps::detail
