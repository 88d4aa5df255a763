#pragma once
// A server's checkpoint as bytes (the caller stores them; ddpx-train writes
// them durably next to its own checkpoints): its shard's values, optimizer
// state, version, counters and staleness record, and where each worker is
// (the pushes of it this server has finished with). Restored, a run goes on
// as if it had not stopped: under sync exactly (every worker's next gradient
// is computed on the saved version); under async the gradients that were in
// flight at the save are computed again on the saved version.
#include <ATen/core/Tensor.h>
#include <ddpx/ps.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <vector>

namespace ddpx::ps::detail {

struct ServerState {
  int server = 0;
  int servers = 0;
  ServerStats stats;
  std::vector<int64_t> next_seq;  // [worker]
  std::vector<at::Tensor> segs;   // the shard's segments (restored in place)
};

std::string save_server_state(const ServerState& s, torch::optim::Optimizer& opt);

// Fills `s` (segments copied into s.segs) and the optimizer; a c10::Error if
// the bytes were written by another server, for another layout or worker
// count.
void load_server_state(const std::string& bytes, ServerState& s, torch::optim::Optimizer& opt);

}  // namespace ddpx::ps::detail
