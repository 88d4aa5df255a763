#pragma once
// Construction-time agreement: same parameters on every rank, rank 0's values
// everywhere.
#include <ddpx/comm.h>

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

// Throws naming the first parameter whose shape or dtype differs, and the
// ranks, or the ranks whose parameter counts differ. Never hangs: every
// collective here has the same size on all ranks.
void verify_same_parameters(c10d::ProcessGroup& pg, const std::vector<std::string>& names,
                            const std::vector<at::Tensor>& params);

// Broadcasts rank 0's values of `tensors` (coalesced per dtype).
void broadcast_from_rank0(c10d::ProcessGroup& pg, const std::vector<at::Tensor>& tensors);

}  // namespace ddpx::hooks
