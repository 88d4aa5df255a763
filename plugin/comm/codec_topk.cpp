// topk:<ratio>: each rank sends its k = ceil(ratio * numel) largest-magnitude
// entries (of input + residual) as one int32 message [k indices | k float32
// values]; every rank all-gathers the messages and scatter-adds them. Exact
// on inputs with at most k nonzeros per rank; error feedback carries the
// entries not sent into the next call.
//
// The budget is per tensor: a packed call (a GradSync bucket) picks each
// part's own ceil(ratio * numel_part) largest from that part alone, so what a
// tensor sends does not depend on which tensors share its bucket (a re-planned
// run repeats bit for bit), and a small tensor is never starved by a large
// one's values. The sum over ranks is added in rank order per element.
#include <ATen/ATen.h>

#include <climits>
#include <cmath>
#include <sstream>

#include "plugin/comm/codec_pack.h"
#include "plugin/comm/codec_util.h"

namespace ddpx::comm::detail {

// Indices of the k largest entries of `a` (1-D, >= 0 or NaN), the set topk
// over all of it gives. A threshold from a strided sample of about 4096
// entries keeps about 1.5k candidates and topk runs on those alone: every
// entry at or above the threshold (and every NaN) is a candidate, so when
// there are at least k of them they hold the true top k. 5-10x faster than
// topk over a large tensor; falls back to it when the sample misjudged (fewer
// than k candidates), for small tensors, and when k is not small.
at::Tensor largest_k(const at::Tensor& a, int64_t k) {
  constexpr int64_t kSample = 4096;
  const int64_t n = a.numel();
  auto full = [&] { return std::get<1>(a.topk(k, /*dim=*/0, /*largest=*/true, /*sorted=*/false)); };
  if (n < 16 * kSample || 4 * k > n) return full();
  const int64_t step = n / kSample;
  const at::Tensor sample = a.slice(0, step / 2, n, step);
  const int64_t m = sample.numel();
  const int64_t keep = std::min<int64_t>(m, 3 * k * m / (2 * n) + 1);
  const at::Tensor t = std::get<0>(sample.kthvalue(m - keep + 1));        // the keep-th largest
  const at::Tensor idx = at::nonzero(at::logical_not(a < t)).squeeze(1);  // NaN: not < t
  if (idx.numel() < k) return full();
  const at::Tensor picked = std::get<1>(a.index_select(0, idx).topk(k, 0, true, false));
  return idx.index_select(0, picked);
}

int64_t topk_count(double ratio, int64_t n) {
  // (1 - 1e-12): 0.01 * 1000 must give k = 10 whatever the binary rounding.
  return std::min<int64_t>(
      n, std::max<int64_t>(
             1, static_cast<int64_t>(std::ceil(ratio * static_cast<double>(n) * (1 - 1e-12)))));
}

at::Tensor topk_pack(const at::Tensor& m, int64_t k, at::Tensor* idx) {
  *idx = largest_k(m.abs(), k);
  const at::Tensor vals = m.index_select(0, *idx);
  return at::cat({idx->to(at::kInt), vals.view(at::kInt)});
}

at::Tensor topk_unpack_sum(const at::Tensor& rows, int64_t n, int64_t k) {
  const at::Tensor all_idx = rows.narrow(1, 0, k).reshape(-1).to(at::kLong);
  const at::Tensor all_vals = rows.narrow(1, k, k).contiguous().view(at::kFloat).reshape(-1);
  return at::zeros({n}, all_vals.options()).index_add_(0, all_idx, all_vals);
}

namespace {

class TopKCodec final : public LossyCodec {
 public:
  TopKCodec(double ratio, std::string text) : ratio_(ratio), text_(std::move(text)) {}

  std::string spec() const override { return "topk:" + text_; }

  at::Tensor allreduce_mean(const at::Tensor& input, const std::string& key,
                            c10d::ProcessGroup& pg) override {
    check_input(input, spec());
    int64_t bytes = check_agreement(pg, input, spec(), key);
    return reduce(input, {input.numel()}, key, pg, bytes);
  }

  at::Tensor allreduce_mean_packed(const at::Tensor& flat,
                                   const std::vector<std::vector<int64_t>>& shapes,
                                   const std::string& key, c10d::ProcessGroup& pg,
                                   const std::vector<std::string>& /*part_keys*/) override {
    int64_t bytes = 0;  // each part's budget follows its numel: agreed on too
    const auto parts = agree_on_part_numels(pg, flat, shapes, spec(), key, &bytes);
    return reduce(flat, parts, key, pg, bytes);
  }

 private:
  at::Tensor reduce(const at::Tensor& input, const std::vector<int64_t>& parts,
                    const std::string& key, c10d::ProcessGroup& pg, int64_t bytes) {
    TORCH_CHECK(input.numel() <= INT32_MAX, "ddpx codec '", spec(), "': input has ", input.numel(),
                " elements; indices travel as int32 (at most ", INT32_MAX, ")");
    const int64_t n = input.numel();
    if (n == 0) {
      count_call(bytes, 0);
      return input.contiguous().clone();
    }
    const at::Tensor x = flat_float(input);
    at::Tensor e = residual(key, x);
    const at::Tensor m = e.defined() ? e.add_(x) : x;  // [n] float32, in the residual's storage
    std::vector<at::Tensor> picked;  // per part: its chosen entries, as indices into m
    int64_t off = 0;
    for (int64_t numel : parts) {
      if (numel > 0) {
        const at::Tensor a = m.narrow(0, off, numel).abs();
        picked.push_back(largest_k(a, topk_count(ratio_, numel)).add_(off));
      }
      off += numel;
    }
    const at::Tensor idx = at::cat(picked);
    const int64_t k = idx.numel();
    const at::Tensor vals = m.index_select(0, idx);
    const at::Tensor msg = at::cat({idx.to(at::kInt), vals.view(at::kInt)});
    const at::Tensor all = allgather_rows(pg, msg, &bytes);  // [world, 2k] int32
    at::Tensor sum = topk_unpack_sum(all, n, k);
    if (e.defined()) {
      e.index_fill_(0, idx, 0.0);  // the residual: what was not sent
      // An inf or NaN is the largest |x| (topk ranks NaN first), so it is
      // sent and the sum carries it; only when more than k of them came can
      // one stay behind, and none may (a NaN residual poisons every later
      // call). The check reads the k values sent, not the residual.
      if (!at::isfinite(vals).all().item<bool>()) e.nan_to_num_(0.0, 0.0, 0.0);
    }
    count_call(bytes, n);
    return to_output(sum.div_(pg.getSize()), input);
  }

  double ratio_;
  std::string text_;
};

const bool registered_topk = register_codec(
    {"topk",
     "topk:<ratio>       the ceil(ratio * numel) largest |x| per rank, 0 < ratio <= 1, "
     "all-gathered as (int32 index, float32 value)",
     [](const std::optional<std::string>& arg) -> std::unique_ptr<Codec> {
       TORCH_CHECK(arg.has_value(), "ddpx codec 'topk' needs a ratio, e.g. topk:0.01\n",
                   codec_grammar());
       const double r = parse_double(*arg, "topk's <ratio>");
       TORCH_CHECK(r > 0 && r <= 1, "ddpx codec: topk's <ratio> must be in (0, 1], got ", *arg,
                   "\n", codec_grammar());
       std::ostringstream os;
       os << r;  // canonical text: "topk:0.010" and "topk:0.01" share a cache entry
       return std::make_unique<TopKCodec>(r, os.str());
     }});

}  // namespace
}  // namespace ddpx::comm::detail
