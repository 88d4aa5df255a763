// powersgd:<rank>: one step of subspace iteration per call (Vogels, Karimireddy
// and Jaggi, "PowerSGD", NeurIPS 2019), per part of the input. A plain call
// has one part, the input; a packed call (a GradSync bucket) one per tensor
// packed in it. Each part of 2 or more dimensions is a matrix
// M_i [rows = size(0), cols = numel / rows] (a conv weight: [out, in*kh*kw]):
//   1. M = input + residual (error feedback, per key; built in place)
//   2. P_i = M_i Q_i               [rows, r]   one SUM-allreduce for all parts,
//                                              the uncompressed parts' values
//                                              riding along
//   3. P_i = orthonormal basis of P_i (Householder QR: identical on every
//                                     rank, all hold the same P_i)
//   4. Q_i = M_i^T P_i             [cols, r]   one SUM-allreduce for all, / world
//   5. result_i = P_i Q_i^T = P_i P_i^T mean(M_i); residual_i = M_i - P_i Q_i^T
//   6. Q_i is kept under the key: the next call's warm start.
// So a bucket costs two collectives whatever it holds (PyTorch's PowerSGD
// hook: three). Without a key (or on a key's first call) Q_i starts from a
// fixed-seed normal matrix, drawn on the CPU so every rank and device starts
// alike. Exact when mean(M_i) has rank <= r. Parts that would not shrink --
// 1-D, or (rows + cols) * r >= rows * cols -- are sent uncompressed (float32
// SUM) and owe no residual; a call with no other part keeps no state.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <sstream>

#include "plugin/comm/codec_util.h"

namespace ddpx::comm::detail {
namespace {

constexpr uint64_t kSeed = 0x5eed5eedULL;

// One part of the input: [offset, offset + rows * cols); r > 0: low rank.
struct Part {
  int64_t offset, rows, cols, r;
  int64_t numel() const { return rows * cols; }
};

class PowerSgdCodec final : public LossyCodec {
 public:
  explicit PowerSgdCodec(int64_t rank) : rank_(rank) {}

  std::string spec() const override { return "powersgd:" + std::to_string(rank_); }

  at::Tensor allreduce_mean(const at::Tensor& input, const std::string& key,
                            c10d::ProcessGroup& pg) override {
    check_input(input, spec());
    const int64_t bytes = check_agreement(pg, input, spec(), key);
    return to_output(reduce_parts(input, {input.sizes().vec()}, key, pg, bytes), input);
  }

  at::Tensor allreduce_mean_packed(const at::Tensor& flat,
                                   const std::vector<std::vector<int64_t>>& shapes,
                                   const std::string& key, c10d::ProcessGroup& pg) override {
    check_packed(flat, shapes, spec());
    std::ostringstream layout;
    for (const auto& s : shapes) layout << c10::IntArrayRef(s);
    const int64_t bytes = check_agreement(pg, flat, spec(), key, layout.str());
    return to_output(reduce_parts(flat, shapes, key, pg, bytes), flat);
  }

 private:
  // The parts of `shapes`, laid end to end; r = 0 where a part is sent as is.
  std::vector<Part> parts_of(const std::vector<std::vector<int64_t>>& shapes) const {
    std::vector<Part> parts;
    int64_t off = 0;
    for (const auto& s : shapes) {
      int64_t numel = 1;
      for (int64_t d : s) numel *= d;
      const int64_t rows = s.size() >= 2 ? s[0] : 1;
      const int64_t cols = rows > 0 ? numel / rows : 0;
      const int64_t r = std::min({rank_, rows, cols});
      if (s.size() >= 2 && numel > 0 && (rows + cols) * r < rows * cols) {
        parts.push_back({off, rows, cols, r});
      } else {
        parts.push_back({off, 1, numel, 0});
      }
      off += numel;
    }
    return parts;
  }

  // The mean (flat float32) of `input` over the ranks, part by part;
  // `bytes`: sent so far (the agreement).
  at::Tensor reduce_parts(const at::Tensor& input, const std::vector<std::vector<int64_t>>& shapes,
                          const std::string& key, c10d::ProcessGroup& pg, int64_t bytes) {
    const int64_t n = input.numel();
    const int64_t world = pg.getSize();
    const auto parts = parts_of(shapes);
    int64_t dense = 0, p_numel = 0, q_numel = 0;
    for (const auto& pt : parts) {
      if (pt.r == 0) dense += pt.numel();
      p_numel += pt.rows * pt.r;
      q_numel += pt.cols * pt.r;
    }
    if (q_numel == 0) {  // nothing shrinks: one float32 SUM, no state
      at::Tensor flat = input.reshape(-1).to(at::kFloat, false, /*copy=*/true).contiguous();
      if (n > 0) bytes += allreduce_sum(pg, flat);
      count_call(bytes, n);
      return flat.div_(world);
    }
    const at::Tensor x = flat_float(input);
    at::Tensor e = residual(key, x);
    // M = input + residual, built in the residual's storage.
    const at::Tensor m = e.defined() ? e.add_(x) : x;
    // [the uncompressed parts | every P_i], one SUM.
    at::Tensor sent = at::empty({dense + p_numel}, x.options());
    std::vector<at::Tensor> p(parts.size());
    int64_t off = 0;
    for (const auto& pt : parts) {
      if (pt.r > 0) continue;
      sent.narrow(0, off, pt.numel()).copy_(m.narrow(0, pt.offset, pt.numel()));
      off += pt.numel();
    }
    for (size_t i = 0; i < parts.size(); ++i) {
      const Part& pt = parts[i];
      if (pt.r == 0) continue;
      p[i] = sent.narrow(0, off, pt.rows * pt.r).view({pt.rows, pt.r});
      at::mm_out(p[i], matrix(m, pt), warm_start(key, i, pt, m.device()));
      off += pt.rows * pt.r;
    }
    bytes += allreduce_sum(pg, sent);
    at::Tensor out = at::empty({n}, x.options());
    // [every Q_i], one SUM; q_local keeps this rank's for the residuals.
    at::Tensor q_local = at::empty({q_numel}, x.options());
    std::vector<at::Tensor> q(parts.size());
    off = 0;
    int64_t dense_off = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const Part& pt = parts[i];
      if (pt.r == 0) {
        at::Tensor dst = out.narrow(0, pt.offset, pt.numel());
        at::div_out(dst, sent.narrow(0, dense_off, pt.numel()), world);
        dense_off += pt.numel();
        continue;
      }
      p[i] = std::get<0>(at::linalg_qr(p[i], "reduced")).contiguous();
      q[i] = q_local.narrow(0, off, pt.cols * pt.r).view({pt.cols, pt.r});
      at::mm_out(q[i], matrix(m, pt).t(), p[i]);
      off += pt.cols * pt.r;
    }
    at::Tensor q_mean = q_local.clone();
    bytes += allreduce_sum(pg, q_mean);
    q_mean.div_(world);
    off = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const Part& pt = parts[i];
      if (pt.r == 0) {
        // Sent whole: it owes nothing.
        if (e.defined()) e.narrow(0, pt.offset, pt.numel()).zero_();
        continue;
      }
      const at::Tensor qm = q_mean.narrow(0, off, pt.cols * pt.r).view({pt.cols, pt.r});
      off += pt.cols * pt.r;
      at::Tensor dst = matrix(out, pt);
      at::mm_out(dst, p[i], qm.t());
      if (e.defined()) {
        set_state(key, "q" + std::to_string(i), qm.clone());
        // residual = M - P Q_local^T, in place (m is the residual's storage).
        matrix(e, pt).addmm_(p[i], q[i].t(), /*beta=*/1, /*alpha=*/-1);
      }
    }
    count_call(bytes, n);
    return out;
  }

  static at::Tensor matrix(const at::Tensor& flat, const Part& pt) {
    return flat.narrow(0, pt.offset, pt.numel()).view({pt.rows, pt.cols});
  }

  // Part i's Q: the key's from the last call if it fits, else the fixed start.
  at::Tensor warm_start(const std::string& key, size_t i, const Part& pt, c10::Device device) {
    at::Tensor q = key.empty() ? at::Tensor() : state(key, "q" + std::to_string(i));
    if (q.defined() && q.size(0) == pt.cols && q.size(1) == pt.r && q.device() == device) return q;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(kSeed);
    return at::randn({pt.cols, pt.r}, gen, at::TensorOptions().dtype(at::kFloat)).to(device);
  }

  int64_t rank_;
};

const bool registered_powersgd = register_codec(
    {"powersgd",
     "powersgd:<rank>    rank-<rank> P/Q power iteration with warm start (rank >= 1), per "
     "matrix; 1-D tensors and those that would not shrink go uncompressed",
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
