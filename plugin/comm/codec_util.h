#pragma once
// Pieces shared by the codec files: the registry that make_codec parses
// against, the door checks, the cross-rank agreement (step 1 of the protocol
// in ddpx/codec.h), thin synchronous wrappers over c10d collectives, and the
// error-feedback base of the lossy codecs.
#include <ddpx/codec.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ddpx::comm::detail {

// A codec file registers its name, its grammar line and a factory that gets
// the text after "<name>:" (nullopt when there is none).
struct CodecEntry {
  std::string name;
  std::string grammar;
  std::function<std::unique_ptr<Codec>(const std::optional<std::string>& arg)> make;
};
bool register_codec(CodecEntry entry);

// Parsing helpers for factories: the whole of `arg` must be the number.
double parse_double(const std::string& arg, const std::string& what);
int64_t parse_int(const std::string& arg, const std::string& what);

// Door check of allreduce_mean: a dense floating tensor.
void check_input(const at::Tensor& input, const std::string& spec);

// Step 1 of the protocol; returns the bytes this rank sent.
int64_t check_agreement(c10d::ProcessGroup& pg, const at::Tensor& input, const std::string& spec,
                        const std::string& key);

// In-place SUM allreduce of a contiguous tensor, waited on; returns bytes sent.
int64_t allreduce_sum(c10d::ProcessGroup& pg, at::Tensor& t);

// All-gathers a contiguous 1-D tensor of L elements into [world, L] (row r =
// rank r's tensor), waited on. Adds this rank's payload bytes to *bytes.
at::Tensor allgather_rows(c10d::ProcessGroup& pg, const at::Tensor& flat, int64_t* bytes);

// Error feedback: a lossy codec encodes m = input + residual (float32, flat);
// what its own contribution c did not carry, m - c, is the next residual.
// Since the result is mean_i(c_i), sum_t result_t = sum_t mean(x_t) - mean(e_T).
class LossyCodec : public Codec {
 protected:
  // [numel] float32 contiguous: input (+ the key's residual), a new tensor.
  at::Tensor compensated(const at::Tensor& input, const std::string& key) const;
  // Stores m - contribution as the key's residual (no-op for key "").
  void keep_residual(const std::string& key, const at::Tensor& m, const at::Tensor& contribution);
};

// Result in the caller's dtype and shape from a float32 [numel] tensor.
at::Tensor to_output(const at::Tensor& flat, const at::Tensor& input);

}  // namespace ddpx::comm::detail
