#pragma once
// Construction-time agreement: same parameters on every rank, rank 0's values
// everywhere.
#include <ddpx/comm.h>

#include <string>
#include <vector>

namespace ddpx::hooks {

// Throws naming the first parameter whose shape or dtype differs, and the
// ranks, or the ranks whose parameter counts differ. Never hangs: every
// collective here has the same size on all ranks.
void verify_same_parameters(c10d::ProcessGroup& pg, const std::vector<std::string>& names,
                            const std::vector<at::Tensor>& params);

// Broadcasts rank 0's values of `tensors` (coalesced per dtype).
void broadcast_from_rank0(c10d::ProcessGroup& pg, const std::vector<at::Tensor>& tensors);

}  // namespace ddpx::hooks
