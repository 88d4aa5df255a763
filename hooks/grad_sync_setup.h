#pragma once
// Construction-time agreement: same parameters on every rank, rank 0's values
// everywhere.
#include <ddpx/comm.h>
#include <ddpx/grad_sync.h>

#include <string>
#include <vector>

namespace ddpx::hooks {

// GradSync's control messages (the model check below, step agreements,
// plans, traces) are small CPU tensors on `pg`, and each bucket goes over a
// channel as a tensor of its parameters' device: throws, before any
// collective, naming the group and the device type that has no backend for
// them (NCCL takes no CPU tensors), rather than failing in the first step.
void require_backends(c10d::ProcessGroup& pg,
                      const std::vector<c10::intrusive_ptr<c10d::ProcessGroup>>& channels,
                      const std::vector<at::Tensor>& params);

// What verify_same_tensors checks, for its messages.
struct TensorKind {
  const char* singular;  // "parameter"
  const char* plural;    // "parameters that require grad"
};
inline constexpr TensorKind kParameters{"parameter", "parameters"};
inline constexpr TensorKind kBuffers{"buffer", "buffers"};

// Throws naming the first tensor whose shape, dtype or requires_grad (frozen
// on one rank, trainable on another) differs, and the ranks, or the ranks
// whose tensor counts differ. Never hangs: every
// collective here has the same size on all ranks.
void verify_same_tensors(c10d::ProcessGroup& pg, const std::vector<std::string>& names,
                         const std::vector<at::Tensor>& tensors, const TensorKind& kind);

// GradSyncOptions::mixed_precision's door: its dtypes (float32, bfloat16,
// float16), the parameters a master is kept of (float32), and the options
// it does not combine with, each named.
void check_mixed_precision(const GradSyncOptions& o, const std::vector<std::string>& names,
                           const std::vector<at::Tensor>& params);

// GradSyncOptions::shard's door: the options it does not combine with, each
// named with it ("Shard::Optimizer" / "Shard::Gradients": shard_name).
void check_shard(const GradSyncOptions& o);
const char* shard_name(Shard s);

// Broadcasts rank 0's values of `tensors` (coalesced per dtype).
void broadcast_from_rank0(c10d::ProcessGroup& pg, const std::vector<at::Tensor>& tensors);

}  // namespace ddpx::hooks
