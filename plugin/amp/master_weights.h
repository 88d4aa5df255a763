#pragma once
// Float32 master copies of low-precision parameters
// (GradSyncOptions::mixed_precision). The parameters themselves are
// converted once, in place, to the low dtype: the same tensors (the model's,
// the optimizer's) then hold param_dtype values, so forward and backward
// compute in it. The optimizer steps the masters (hooks/bucket_optimizer.h
// runs its step on them), and write() rounds the stepped masters into the
// parameters the next forward reads.
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace ddpx::amp {

// Converts `t` in place to `dtype` (its TensorImpl stays, so every holder
// sees the new dtype). The autograd accumulator of a tensor whose dtype
// changes is dropped by ATen: convert before hooking one. A .grad of the old
// dtype is dropped too.
void convert_in_place(const at::Tensor& t, at::ScalarType dtype);

class MasterWeights {
 public:
  MasterWeights() = default;
  // Float32 copies of `params` (as they are now), then each parameter
  // converted in place to param_dtype.
  MasterWeights(const std::vector<at::Tensor>& params, at::ScalarType param_dtype);

  bool active() const { return !masters_.empty(); }
  const at::Tensor& master(int p) const { return masters_[p]; }
  const std::vector<at::Tensor>& masters() const { return masters_; }
  // masters[p] rounded into params[p], for each p in `ps` (inactive: none).
  void write(const std::vector<int>& ps) const;
  // New master values (a checkpoint's; float32, the parameters' shapes),
  // and the parameters rounded from them.
  void load(const std::vector<at::Tensor>& values, const std::vector<std::string>& names);

 private:
  std::vector<at::Tensor> params_, masters_;
};

}  // namespace ddpx::amp
