// ddpx/data.h: world-size-invariant data order.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ddpx/data.h>

namespace ddpx::data {

at::Tensor epoch_permutation(int64_t n, int64_t epoch, uint64_t seed) {
  TORCH_CHECK(n >= 0, "ddpx::data::epoch_permutation: n must be >= 0, got ", n);
  TORCH_CHECK(epoch >= 0, "ddpx::data::epoch_permutation: epoch must be >= 0, got ", epoch);
  // (The generator's seed mixes seed and epoch: ddpx-train's checkpoints and
  // data order depend on this exact formula.)
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ULL + uint64_t(epoch));
  return at::randperm(n, gen, at::kLong);
}

int64_t steps_per_epoch(int64_t n, int64_t global_batch) {
  TORCH_CHECK(global_batch > 0, "ddpx::data::steps_per_epoch: global_batch must be > 0, got ",
              global_batch);
  return n / global_batch;
}

at::Tensor global_batch_slice(const at::Tensor& permutation, int64_t step, int64_t global_batch,
                              int rank, int world) {
  TORCH_CHECK(permutation.dim() == 1 && permutation.scalar_type() == at::kLong,
              "ddpx::data::global_batch_slice: permutation must be 1-D int64, got ",
              permutation.sizes(), " ", permutation.scalar_type());
  TORCH_CHECK(world > 0 && rank >= 0 && rank < world, "ddpx::data::global_batch_slice: rank ", rank,
              " is not in [0, world = ", world, ")");
  TORCH_CHECK(global_batch > 0 && global_batch % world == 0,
              "ddpx::data::global_batch_slice: global_batch ", global_batch,
              " must be a positive multiple of world ", world);
  TORCH_CHECK(step >= 0 && (step + 1) * global_batch <= permutation.numel(),
              "ddpx::data::global_batch_slice: step ", step, " of ", global_batch,
              " samples is outside the permutation's ", permutation.numel(), " (",
              permutation.numel() / global_batch, " whole steps)");
  return permutation.narrow(0, step * global_batch, global_batch)
      .view({global_batch / world, world})
      .select(1, rank)
      .contiguous();
}

}  // namespace ddpx::data
