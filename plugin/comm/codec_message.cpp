#include "plugin/comm/codec_message.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sstream>

#include "kernels/common/int8_codec.h"
#include "ops/int8_codec.h"
#include "plugin/comm/codec_pack.h"
#include "plugin/comm/codec_util.h"

namespace ddpx::comm {
namespace {

at::Tensor as_bytes(const at::Tensor& t) { return t.contiguous().view(at::kByte).reshape(-1); }

}  // namespace

MessageCodec MessageCodec::parse(const std::string& spec) {
  const auto codec = make_codec(spec);  // validates the grammar, canonical spelling
  const std::string canon = codec->spec();
  MessageCodec m;
  if (canon == "none") return m;
  if (canon == "fp16" || canon == "bf16") {
    m.id = canon == "fp16" ? WireCodec::Fp16 : WireCodec::Bf16;
    return m;
  }
  if (canon.rfind("int8", 0) == 0) {
    m.id = WireCodec::Int8;
    m.chunk = canon == "int8" ? 256 : detail::parse_int(canon.substr(5), "int8's <chunk>");
    return m;
  }
  if (canon.rfind("topk:", 0) == 0) {
    m.id = WireCodec::TopK;
    m.ratio = detail::parse_double(canon.substr(5), "topk's <ratio>");
    return m;
  }
  TORCH_CHECK(false, "ddpx: codec '", spec,
              "' has no point-to-point form (it needs several rounds); use none, fp16, bf16, "
              "int8[:<chunk>] or topk:<ratio>");
}

MessageCodec MessageCodec::from_wire(int32_t id, int64_t chunk, double ratio) {
  MessageCodec m;
  switch (static_cast<WireCodec>(id)) {
    case WireCodec::None:
    case WireCodec::Fp16:
    case WireCodec::Bf16:
      m.id = static_cast<WireCodec>(id);
      return m;
    case WireCodec::Int8:
      TORCH_CHECK(chunk >= 1 && chunk <= (1 << 20), "ddpx: message header has int8 chunk ", chunk,
                  ", outside [1, 2^20]");
      m.id = WireCodec::Int8;
      m.chunk = chunk;
      return m;
    case WireCodec::TopK:
      TORCH_CHECK(ratio > 0 && ratio <= 1, "ddpx: message header has topk ratio ", ratio,
                  ", outside (0, 1]");
      m.id = WireCodec::TopK;
      m.ratio = ratio;
      return m;
  }
  TORCH_CHECK(false, "ddpx: message header names codec id ", id, ", which is no codec (0..4)");
}

std::string MessageCodec::spec() const {
  switch (id) {
    case WireCodec::None:
      return "none";
    case WireCodec::Fp16:
      return "fp16";
    case WireCodec::Bf16:
      return "bf16";
    case WireCodec::Int8:
      return chunk == 256 ? "int8" : "int8:" + std::to_string(chunk);
    case WireCodec::TopK: {
      std::ostringstream os;
      os << "topk:" << ratio;
      return os.str();
    }
  }
  return "?";
}

int64_t MessageCodec::message_bytes(int64_t numel) const {
  switch (id) {
    case WireCodec::None:
      return 4 * numel;
    case WireCodec::Fp16:
    case WireCodec::Bf16:
      return 2 * numel;
    case WireCodec::Int8:
      return kernels::int8_codec::packed_bytes(numel, chunk);
    case WireCodec::TopK:
      return numel == 0 ? 0 : 8 * detail::topk_count(ratio, numel);
  }
  return -1;
}

at::Tensor MessageCodec::encode(const at::Tensor& x, at::Tensor residual) const {
  TORCH_INTERNAL_ASSERT(x.dim() == 1 && x.scalar_type() == at::kFloat && x.is_contiguous());
  const int64_t n = x.numel();
  if (n == 0) return at::empty({0}, x.options().dtype(at::kByte));
  switch (id) {
    case WireCodec::None:
      return as_bytes(x);
    case WireCodec::Fp16:
    case WireCodec::Bf16:
      return as_bytes(detail::half_pack_ef(x, residual,
                                           id == WireCodec::Fp16 ? at::kHalf : at::kBFloat16,
                                           /*world=*/1));
    case WireCodec::Int8:
      return residual.defined() ? ddpx::detail::int8_pack_ef(x, residual, chunk)
                                : ddpx::detail::int8_pack(x, chunk);
    case WireCodec::TopK: {
      const at::Tensor m = residual.defined() ? residual.add_(x) : x;
      at::Tensor idx;
      const at::Tensor msg = detail::topk_pack(m, detail::topk_count(ratio, n), &idx);
      if (residual.defined()) residual.index_fill_(0, idx, 0.0);  // what was not sent
      return as_bytes(msg);
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unreachable");
}

at::Tensor MessageCodec::decode(const at::Tensor& msg, int64_t numel) const {
  TORCH_INTERNAL_ASSERT(msg.dim() == 1 && msg.scalar_type() == at::kByte);
  const int64_t want = message_bytes(numel);
  TORCH_CHECK(msg.numel() == want, "ddpx: a ", spec(), " message of ", numel, " elements has ",
              want, " bytes, got ", msg.numel());
  const at::Tensor m = msg.contiguous();
  if (numel == 0) return at::empty({0}, at::kFloat);
  switch (id) {
    case WireCodec::None:
      return m.view(at::kFloat).clone();
    case WireCodec::Fp16:
      return m.view(at::kHalf).to(at::kFloat);
    case WireCodec::Bf16:
      return m.view(at::kBFloat16).to(at::kFloat);
    case WireCodec::Int8:
      return ddpx::detail::int8_unpack_sum(m.view({1, want}), numel, chunk);
    case WireCodec::TopK: {
      const int64_t k = detail::topk_count(ratio, numel);
      const at::Tensor rows = m.view(at::kInt).view({1, 2 * k});
      const at::Tensor idx = rows.narrow(1, 0, k);
      TORCH_CHECK(idx.min().item<int32_t>() >= 0 && idx.max().item<int32_t>() < numel,
                  "ddpx: a topk message of ", numel, " elements holds an index outside [0, ", numel,
                  ")");
      return detail::topk_unpack_sum(rows, numel, k);
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unreachable");
}

}  // namespace ddpx::comm
