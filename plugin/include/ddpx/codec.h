#pragma once
// Compression codecs: the on-wire protocol of a compressed mean-allreduce,
// shared by ddpx::compressed_allreduce and GradSync.
//
// Codec grammar (make_codec):
//   none               float allreduce in the input's own dtype (exact reference)
//   fp16 | bf16        x/world cast to half / bfloat16, summed in rank order in
//                      float32 and rounded once (detail::ordered_sum), cast back
//   int8[:<chunk>]     per-chunk absmax int8 codes + float32 scales (chunk
//                      elements per scale, default 256), all-gathered; every
//                      rank decodes and sums the world's contributions locally
//   topk:<ratio>       the k = ceil(ratio * numel) largest |x| (0 < ratio <= 1),
//                      indices and values all-gathered, summed
//   powersgd:<rank>    rank-r P/Q power iteration (Vogels et al. 2019): P = M Q,
//                      sum P, orthogonalise, Q = M^T P, sum Q (each sum added
//                      in rank order, so a tensor's result does not depend
//                      on its packing); Q is
//                      the warm start of the next call; tensors that would not
//                      shrink (1-D, or (rows + cols) * r >= rows * cols) are
//                      sent uncompressed. A packed call (allreduce_mean_packed)
//                      does this per part, all parts' P in one sum (with the
//                      uncompressed parts) and all Q in another
// Every lossy codec keeps an error-feedback residual per key: the part of
// (input + residual) that this rank's contribution did not carry is added to
// the next call's input, so over many calls the sum of the results tracks the
// sum of the true means. key "" is stateless (no residual, cold PowerSGD start).
// An inf or NaN in any rank's input is inf or NaN in every rank's mean (a
// GradScaler skips the step on it, ddpx/amp.h): none and fp16/bf16 at that
// element (fp16 also where x/world overflows 65504), int8 over its chunk
// (through the chunk's scale), top-k at that element (an inf or NaN is the
// largest |x|, so it is sent), PowerSGD over its matrix (through P, the QR
// and Q). The state keeps none of it: a residual entry (int8: the chunk's)
// or a PowerSGD Q that would be inf or NaN is dropped, so later calls on
// finite inputs are finite again.
//
// Protocol of allreduce_mean (every rank, same order):
//   1. agreement: a 12-int64 MAX-allreduce of (numel, dtype, shape, codec,
//      key) and its negation; any difference is an error on every rank
//      instead of a hang or a wrong sum;
//   2. the codec's collectives (each Work is waited on), then decoding.
// Floating inputs only (float32/64, float16, bfloat16); lossy codecs compute
// in float32. The call is synchronous and thread-safe; calls that share a
// process group must be issued in the same order on every rank.
//
// Bytes counted (stats): bytes_sent is this rank's input payload summed over
// the collectives it calls (agreement included), independent of the backend's
// algorithm; bytes_raw is 4 * numel (float32-equivalent). Their ratio is the
// measured compression ratio.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

namespace ddpx::comm {

struct CodecStats {
  int64_t calls = 0;
  int64_t bytes_sent = 0;
  int64_t bytes_raw = 0;  // float32-equivalent bytes of the inputs
};

class Codec {
 public:
  virtual ~Codec() = default;
  // Canonical spec, e.g. "topk:0.01"; make_codec(spec()) makes an equal codec.
  virtual std::string spec() const = 0;
  // Mean of `input` over the ranks of `pg`; a new tensor of input's shape,
  // dtype and device. `key` names the persistent state ("" = stateless).
  virtual at::Tensor allreduce_mean(const at::Tensor& input, const std::string& key,
                                    c10d::ProcessGroup& pg) = 0;
  // The mean of several tensors packed end to end into the 1-D `flat` (a
  // GradSync bucket): `shapes` are theirs, in order, their numels summing to
  // flat's. Element-wise codecs (none, fp16, bf16, int8, top-k) see one
  // tensor (this default); a codec whose compression depends on shape
  // (PowerSGD: a matrix per part of 2 or more dimensions, viewed as [size(0),
  // numel / size(0)], a conv weight as [out, in * kh * kw]) overrides it.
  // The ranks must agree on `shapes` too (part of the agreement).
  // `part_keys`: empty, or one name per part under which a codec keeps the
  // state that belongs to the tensor rather than to this packing of it
  // (PowerSGD's warm start). A caller that packs its tensors anew (GradSync
  // re-planning its buckets) passes the same name for the same tensor and
  // the state follows it. Empty: that state is kept under `key`.
  virtual at::Tensor allreduce_mean_packed(const at::Tensor& flat,
                                           const std::vector<std::vector<int64_t>>& shapes,
                                           const std::string& key, c10d::ProcessGroup& pg,
                                           const std::vector<std::string>& part_keys);
  at::Tensor allreduce_mean_packed(const at::Tensor& flat,
                                   const std::vector<std::vector<int64_t>>& shapes,
                                   const std::string& key, c10d::ProcessGroup& pg) {
    return allreduce_mean_packed(flat, shapes, key, pg, {});
  }

  // The sharded form (GradSyncOptions::shard, ZeRO): the same mean of the
  // packed `flat`, each of its `runs` delivered to its owner only -- a
  // reduce-scatter with uneven parts (one all-to-all of the encoded runs;
  // the owner decodes and adds the world's contributions in rank order).
  // `runs` tile flat in order, their ranks strictly ascending (a rank may
  // own nothing). Returns this rank's run of the mean, a new [numel] tensor
  // of flat's dtype, or an undefined tensor when it owns none. Error
  // feedback as allreduce_mean: `key`'s residual is this rank's over all of
  // flat -- what it sent every owner (a residual of the owned run alone
  // would drop the error of the other runs' contributions).
  //   fp16, bf16  bit for bit the owner's elements of allreduce_mean_packed
  //               (the same encoding, residual and rank-order sum);
  //   int8        chunks restart where a run starts within a tensor, so each
  //               run's codes decode with its own scales ("per-part scales");
  //               the chunks that do not straddle a run's start are the
  //               unsharded ones, bit for bit; a straddling chunk is cut in two,
  //               each piece within absmax/254 of its own elements;
  //   the rest    has_scatter() is false and this is an error: top-k's budget
  //               and PowerSGD's P = M Q are over whole tensors, which a run
  //               may cut ("none" is reduced exactly by GradSync itself).
  struct Run {
    int64_t offset = 0;  // in flat, elements
    int64_t numel = 0;
    int rank = 0;  // the owner
  };
  virtual bool has_scatter() const { return false; }
  virtual at::Tensor reduce_scatter_mean_packed(const at::Tensor& flat,
                                                const std::vector<std::vector<int64_t>>& shapes,
                                                const std::vector<Run>& runs,
                                                const std::string& key, c10d::ProcessGroup& pg);

  CodecStats stats() const;
  // Drops one key's state ("" = every key's).
  void reset_state(const std::string& key = "");
  // Drops every key's state but the warm starts kept under part keys and
  // returns each key's error-feedback residual (flat float32, the key's input
  // numel): the part of this rank's inputs its contributions have not
  // carried yet. A caller that changes what its keys hold (GradSync
  // re-planning its buckets) adds these back to the next inputs of the same
  // elements, so no error is lost.
  std::map<std::string, at::Tensor> take_residuals();
  // Copies of every key's residual, the state left as it is (a checkpoint).
  std::map<std::string, at::Tensor> residuals() const;
  // The residual under `key` itself, not a copy (flat float32; the next call
  // under `key` updates it in place), undefined before the key's first
  // call. For a caller that sends elements no rank will use (GradSync's
  // sharded bucket goes whole, with the parameters no rank used this step)
  // and puts their residual back after the call, so the error they owe
  // waits for the step that uses them.
  at::Tensor live_residual(const std::string& key) const { return state(key, "residual"); }
  // Copies of the warm starts kept under part keys (PowerSGD: Q^T, [r, cols]
  // float32, the same on every rank), by part key; and setting them again
  // (a checkpoint's). A warm start that does not fit its part when next
  // used (another rank r, shape or device) is ignored: a cold start.
  std::map<std::string, at::Tensor> warm_starts() const;
  void load_warm_starts(const std::map<std::string, at::Tensor>& by_part_key);

 protected:
  // Per-key named state tensors ("residual", PowerSGD's "q<i>"; kWarm under
  // a part key); undefined when absent.
  at::Tensor state(const std::string& key, const std::string& slot) const;
  void set_state(const std::string& key, const std::string& slot, const at::Tensor& value);
  static constexpr const char* kWarm = "warm";  // a part key's warm start
  void count_call(int64_t bytes_sent, int64_t numel);
  void count_bytes(int64_t bytes_sent);

 private:
  mutable std::mutex mu_;
  CodecStats stats_;
  std::map<std::string, std::map<std::string, at::Tensor>> state_;
};

// Parses the grammar above; a bad spec is a c10::Error that lists the codecs.
std::unique_ptr<Codec> make_codec(const std::string& spec);

// The grammar as one line per codec (for error messages and --help).
std::string codec_grammar();

// The process's world group for codec users: ddpx_mpi over all ranks when
// launched by mpirun (made on first use, collectively, then cached), else the
// default group torch.distributed registered (group name "0").
c10::intrusive_ptr<c10d::ProcessGroup> world();

// "" -> world(); otherwise a group registered with c10d (torch.distributed
// registers every group under its group_name).
c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(const std::string& name);

}  // namespace ddpx::comm
