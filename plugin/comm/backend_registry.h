#pragma once
// Backends register a creator under their name from their own file (adding a
// transport is adding a file); make() picks one at run time.
#include <ddpx/comm.h>

#include <functional>
#include <string>
#include <vector>

namespace ddpx::comm::detail {

struct BackendArgs {
  c10::intrusive_ptr<c10d::Store> store;  // null for ddpx_mpi
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{};
  std::string name;
};

struct BackendEntry {
  std::string name;
  c10d::ProcessGroup::BackendType type;
  bool needs_store;
  std::function<BackendPtr(const BackendArgs&)> create;
  // Whether it reduces a device's tensors through host memory (Gloo's CPU
  // algorithms; ddpx_mpi over an MPI that is not CUDA-aware) rather than in
  // device memory (NCCL). Null: device memory.
  std::function<bool()> host_only = nullptr;
};

bool register_backend(BackendEntry entry);
const BackendEntry* find_backend(const std::string& name);
std::vector<std::string> backend_names();

// Whether a caller holding a tensor of device type `type` (not the CPU) may
// stage it through host memory itself: pg's backend for `type` is a
// registered host-only one and pg also serves CPU tensors (which the staged
// chunks are). allreduce_sum (codec_util.h) then pipelines the copies (host_stage.h).
bool stages_through_host(c10d::ProcessGroup& pg, c10::DeviceType type);

}  // namespace ddpx::comm::detail
