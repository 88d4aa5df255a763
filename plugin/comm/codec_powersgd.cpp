// powersgd:<rank>: one step of subspace iteration per call (Vogels, Karimireddy
// and Jaggi, "PowerSGD", NeurIPS 2019), on the input viewed as a matrix
// M [rows = size(0), cols = numel / rows]:
//   1. M = input + residual (error feedback, per key; built in place)
//   2. P = M Q                       [rows, r]   SUM-allreduce
//   3. P = orthonormal basis of P    (Householder QR: identical on every rank,
//                                     all hold the same P)
//   4. Q_i = M_i^T P                 [cols, r]   SUM-allreduce, / world
//   5. result = P Q^T = P P^T mean(M_i); residual_i = M_i - P Q_i^T
//   6. Q is kept under the key: the next call's warm start.
// Without a key (or on a key's first call) Q starts from a fixed-seed normal
// matrix, drawn on the CPU so every rank and device starts alike. Exact when
// mean(M) has rank <= r. Tensors that would not shrink -- 1-D, or
// (rows + cols) * r >= rows * cols -- are sent uncompressed (float32 SUM).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>

#include "plugin/comm/codec_util.h"

namespace ddpx::comm::detail {
namespace {

constexpr uint64_t kSeed = 0x5eed5eedULL;

class PowerSgdCodec final : public LossyCodec {
 public:
  explicit PowerSgdCodec(int64_t rank) : rank_(rank) {}

  std::string spec() const override { return "powersgd:" + std::to_string(rank_); }

  at::Tensor allreduce_mean(const at::Tensor& input, const std::string& key,
                            c10d::ProcessGroup& pg) override {
    check_input(input, spec());
    int64_t bytes = check_agreement(pg, input, spec(), key);
    const int64_t n = input.numel();
    const int64_t world = pg.getSize();
    const int64_t rows = input.dim() >= 2 ? input.size(0) : 1;
    const int64_t cols = rows > 0 ? n / rows : 0;
    const int64_t r = std::min({rank_, rows, cols});
    if (input.dim() < 2 || n == 0 || (rows + cols) * r >= rows * cols) {
      at::Tensor flat = input.reshape(-1).to(at::kFloat, false, /*copy=*/true).contiguous();
      if (n > 0) bytes += allreduce_sum(pg, flat);
      count_call(bytes, n);
      return to_output(flat.div_(world), input);
    }
    const at::Tensor x = flat_float(input);
    at::Tensor e = residual(key, x);
    // M = input + residual, built in the residual's storage.
    at::Tensor m = (e.defined() ? e.add_(x) : x).view({rows, cols});
    at::Tensor q = key.empty() ? at::Tensor() : state(key, "q");
    if (!q.defined() || q.size(0) != cols || q.size(1) != r || q.device() != m.device()) {
      q = initial_q(cols, r).to(m.device());
    }
    at::Tensor p = m.mm(q).contiguous();  // [rows, r]
    bytes += allreduce_sum(pg, p);
    p = std::get<0>(at::linalg_qr(p, "reduced")).contiguous();
    at::Tensor q_local = m.t().mm(p).contiguous();  // [cols, r]
    at::Tensor q_mean = q_local.clone();
    bytes += allreduce_sum(pg, q_mean);
    q_mean.div_(world);
    at::Tensor out = p.mm(q_mean.t());  // [rows, cols]
    if (e.defined()) {
      set_state(key, "q", q_mean);
      // residual = M - P Q_local^T, in place (m is the residual's storage).
      m.addmm_(p, q_local.t(), /*beta=*/1, /*alpha=*/-1);
    }
    count_call(bytes, n);
    return to_output(out.reshape(-1), input);
  }

 private:
  static at::Tensor initial_q(int64_t cols, int64_t r) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(kSeed);
    return at::randn({cols, r}, gen, at::TensorOptions().dtype(at::kFloat));
  }

  int64_t rank_;
};

const bool registered = register_codec(
    {"powersgd",
     "powersgd:<rank>    rank-<rank> P/Q power iteration with warm start (rank >= 1); "
     "1-D and tensors that would not shrink go uncompressed",
     [](const std::optional<std::string>& arg) -> std::unique_ptr<Codec> {
       TORCH_CHECK(arg.has_value(), "ddpx codec 'powersgd' needs a rank, e.g. powersgd:4\n",
                   codec_grammar());
       const int64_t r = parse_int(*arg, "powersgd's <rank>");
       TORCH_CHECK(r >= 1 && r <= 1024, "ddpx codec: powersgd's <rank> must be in [1, 1024], got ",
                   r, "\n", codec_grammar());
       return std::make_unique<PowerSgdCodec>(r);
     }});

}  // namespace
}  // namespace ddpx::comm::detail
