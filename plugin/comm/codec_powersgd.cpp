// powersgd:<rank>: one step of subspace iteration per call (Vogels, Karimireddy
// and Jaggi, "PowerSGD", NeurIPS 2019), per part of the input. A plain call
// has one part, the input; a packed call (a GradSync bucket) one per tensor
// packed in it. Each part of 2 or more dimensions is a matrix
// M_i [rows = size(0), cols = numel / rows] (a conv weight: [out, in*kh*kw]):
//   1. M = input + residual (error feedback, per key; built in place)
//   2. P_i = M_i Q_i               [rows, r]   one SUM for all parts,
//                                              the uncompressed parts' values
//                                              riding along
//   3. P_i = orthonormal basis of P_i (Householder QR: identical on every
//                                     rank, all hold the same P_i)
//   4. Q_i^T = P_i^T M_i           [r, cols]   one SUM for all, / world
//   5. result_i = P_i Q_i^T = P_i P_i^T mean(M_i); residual_i = M_i - P_i Q_i^T
//   6. Q_i^T is kept: the next call's warm start, under the part's own key
//      when the caller names its parts (GradSync: per parameter, so a warm
//      start outlives a re-plan), else under the call's key.
// Q is held transposed, [r, cols] row-major, and the passes over M are our
// own on the CPU (kernels/common/powersgd.h): their results do not depend
// on where a matrix sits in a bucket, which MKL's did not promise.
// So a bucket costs two collectives whatever it holds (PyTorch's PowerSGD
// hook: three). Without a key (or on a key's first call) Q_i starts from a
// fixed-seed normal matrix, drawn on the CPU so every rank and device starts
// alike. Exact when mean(M_i) has rank <= r. Parts that would not shrink --
// 1-D, or (rows + cols) * r >= rows * cols -- are sent uncompressed (float32
// SUM) and owe no residual; a call with no other part keeps no state.
// Each SUM is added up in rank order (ordered_sum): a tensor's result then
// depends on its own values only, not on what it was packed with, on any
// number of ranks and any backend -- part of the promise that a run repeats
// whatever the bucket plan. It moves an allreduce's bytes (a small one beyond
// two ranks: an all-gather, (w - 1) times the P or Q received).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <sstream>
#include <utility>

#include "kernels/common/powersgd.h"
#include "plugin/comm/codec_util.h"

namespace ddpx::comm::detail {
namespace {

namespace psk = kernels::powersgd;

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
    return to_output(reduce_parts(input, {input.sizes().vec()}, key, {}, pg, bytes), input);
  }

  at::Tensor allreduce_mean_packed(const at::Tensor& flat,
                                   const std::vector<std::vector<int64_t>>& shapes,
                                   const std::string& key, c10d::ProcessGroup& pg,
                                   const std::vector<std::string>& part_keys) override {
    check_packed(flat, shapes, spec());
    TORCH_CHECK(part_keys.empty() || part_keys.size() == shapes.size(), "ddpx codec '", spec(),
                "': part_keys must be empty or one per part (", shapes.size(), "), got ",
                part_keys.size());
    std::ostringstream layout;
    for (const auto& s : shapes) layout << c10::IntArrayRef(s);
    const int64_t bytes = check_agreement(pg, flat, spec(), key, layout.str());
    return to_output(reduce_parts(flat, shapes, key, part_keys, pg, bytes), flat);
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
                          const std::string& key, const std::vector<std::string>& part_keys,
                          c10d::ProcessGroup& pg, int64_t bytes) {
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
      at::Tensor flat = flat_float(input);
      if (n > 0) flat = ordered_sum(pg, flat, &bytes);
      count_call(bytes, n);
      return n > 0 ? flat.div_(world) : flat.clone();
    }
    const at::Tensor x = flat_float(input);
    at::Tensor e = residual(key, x);
    // M = input + residual, built in the residual's storage (a matrix's in
    // the same pass as its P).
    const at::Tensor m = e.defined() ? e : x;
    // [the uncompressed parts | every P_i], one SUM (ordered_sum).
    at::Tensor sent = at::empty({dense + p_numel}, x.options());
    std::vector<at::Tensor> p(parts.size());
    int64_t off = 0;
    for (const auto& pt : parts) {
      if (pt.r > 0) continue;
      if (e.defined()) e.narrow(0, pt.offset, pt.numel()).add_(x.narrow(0, pt.offset, pt.numel()));
      sent.narrow(0, off, pt.numel()).copy_(m.narrow(0, pt.offset, pt.numel()));
      off += pt.numel();
    }
    for (size_t i = 0; i < parts.size(); ++i) {
      const Part& pt = parts[i];
      if (pt.r == 0) continue;
      p[i] = sent.narrow(0, off, pt.rows * pt.r).view({pt.rows, pt.r});
      psk::project(matrix(m, pt), e.defined() ? matrix(x, pt) : at::Tensor(),
                   warm_start(key, part_keys, i, pt, m.device()), p[i]);
      off += pt.rows * pt.r;
    }
    sent.copy_(ordered_sum(pg, sent, &bytes));  // in place: p[i] view it
    at::Tensor out = at::empty({n}, x.options());
    // [every Q_i^T], one SUM; qt_local keeps this rank's for the residuals.
    at::Tensor qt_local = at::empty({q_numel}, x.options());
    std::vector<at::Tensor> qt(parts.size());
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
      qt[i] = qt_local.narrow(0, off, pt.r * pt.cols).view({pt.r, pt.cols});
      psk::back_project(matrix(m, pt), p[i], qt[i]);
      off += pt.r * pt.cols;
    }
    const at::Tensor qt_mean = ordered_sum(pg, qt_local, &bytes).div_(world);
    // An inf or NaN in any rank's M_i reaches its P_i sum, the QR and so Q_i:
    // the part's result is NaN on every rank (what a GradScaler must see).
    // Its Q_i and residual would be NaN too and poison every later call, so
    // such a part keeps neither: a cold start and no residual (Q is the same
    // on every rank, so every rank drops the same parts).
    const bool all_finite = at::isfinite(qt_mean).all().item<bool>();
    off = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const Part& pt = parts[i];
      if (pt.r == 0) {
        // Sent whole: it owes nothing.
        if (e.defined()) e.narrow(0, pt.offset, pt.numel()).zero_();
        continue;
      }
      const at::Tensor qtm = qt_mean.narrow(0, off, pt.r * pt.cols).view({pt.r, pt.cols});
      off += pt.r * pt.cols;
      // The result, and the residual = M - P Q_local^T in place (m is the
      // residual's storage).
      psk::expand(p[i], qtm, matrix(out, pt), qt[i], e.defined() ? matrix(e, pt) : at::Tensor());
      if (!e.defined()) continue;
      if (all_finite || at::isfinite(qtm).all().item<bool>()) {
        keep_warm_start(key, part_keys, i, qtm);
      } else {
        keep_warm_start(key, part_keys, i, at::Tensor());
        matrix(e, pt).zero_();
      }
    }
    count_call(bytes, n);
    return out;
  }

  static at::Tensor matrix(const at::Tensor& flat, const Part& pt) {
    return flat.narrow(0, pt.offset, pt.numel()).view({pt.rows, pt.cols});
  }

  // Where part i's warm start lives: its own key, or the call's slot "q<i>".
  static std::pair<std::string, std::string> warm_slot(const std::string& key,
                                                       const std::vector<std::string>& part_keys,
                                                       size_t i) {
    if (!part_keys.empty()) return {part_keys[i], kWarm};
    return {key, "q" + std::to_string(i)};
  }

  // Part i's Q^T: the last call's if it fits, else the fixed start.
  at::Tensor warm_start(const std::string& key, const std::vector<std::string>& part_keys,
                        size_t i, const Part& pt, c10::Device device) {
    at::Tensor qt;
    if (!key.empty()) {
      const auto [k, slot] = warm_slot(key, part_keys, i);
      qt = state(k, slot);
    }
    if (qt.defined() && qt.size(0) == pt.r && qt.size(1) == pt.cols && qt.device() == device) {
      return qt;
    }
    auto gen = at::make_generator<at::CPUGeneratorImpl>(kSeed);
    return at::randn({pt.r, pt.cols}, gen, at::TensorOptions().dtype(at::kFloat)).to(device);
  }

  // (A view into the call's Q buffer: no copy per part; the buffer lives as
  // long as one of its parts' warm starts does.)
  void keep_warm_start(const std::string& key, const std::vector<std::string>& part_keys,
                       size_t i, const at::Tensor& qt) {
    const auto [k, slot] = warm_slot(key, part_keys, i);
    set_state(k, slot, qt);
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
