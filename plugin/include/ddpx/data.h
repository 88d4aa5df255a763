#pragma once
// Data order that does not depend on the world size, for trainers that must
// go on after a change of world size (a torchrun restart with fewer or more
// workers, a resume at another scale): which samples a global batch holds is
// a function of (seed, epoch, step) alone, and each rank takes an equal slice
// of it. ddpx-train's --global-batch is this.
//
// An epoch visits a permutation of the n samples drawn from (seed, epoch);
// global step k of an epoch is the permutation's elements
// [k * B, (k + 1) * B), B the global batch, dealt round-robin: rank r of W
// takes elements k * B + r, k * B + r + W, ... (B / W of them). So at any W
// dividing B the ranks' slices together are the same B samples, and a run
// stopped at step k by W ranks goes on at step k with W' ranks on the very
// batch the uninterrupted run would have taken next. With GradSync averaging
// the ranks' mean losses, the step then equals one process on the whole
// global batch up to float32 summation order.
//
// (tests/cpp/test_data_slicing.cpp runs this text as it stands, with n, B,
// seed, epoch, step, rank and world set, and checks that the ranks' slices
// make up the global batch at 1, 2 and 3 ranks:)
// [example data_slicing]
//   const at::Tensor perm = ddpx::data::epoch_permutation(n, epoch, seed);
//   const int64_t steps_per_epoch = ddpx::data::steps_per_epoch(n, B);
//   const at::Tensor mine = ddpx::data::global_batch_slice(perm, step, B, rank, world);
//   // train on samples `mine` (B / world of them) ...
// [end example]
//
// After a change of world size, a GradSync built over the new group takes the
// old run's GradSync::State (load_state): its plan order, order predictor and
// PowerSGD warm starts are the same at any world size; a lossy codec's
// residuals are per rank -- pass a surviving rank its own or none (empty).
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ddpx::data {

// The permutation of [0, n) that epoch `epoch` visits: int64 [n], drawn from
// (seed, epoch) on the CPU, the same on every rank and at every world size.
at::Tensor epoch_permutation(int64_t n, int64_t epoch, uint64_t seed);

// Whole global batches of `global_batch` samples in an epoch of n (the
// remainder is left out). global_batch > 0.
int64_t steps_per_epoch(int64_t n, int64_t global_batch);

// Rank `rank` of `world`'s slice of global step `step`: the permutation's
// elements step * B + rank + j * world, j < B / world (int64 [B / world]).
// B must be divisible by world and the step inside the permutation; a clear
// error names the argument otherwise.
at::Tensor global_batch_slice(const at::Tensor& permutation, int64_t step, int64_t global_batch,
                              int rank, int world);

}  // namespace ddpx::data
