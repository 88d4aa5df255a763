// Group resolution for codec users (ddpx::compressed_allreduce): "" is the
// process's world group, anything else a group registered with c10d.
#include <ddpx/codec.h>
#include <ddpx/comm.h>

#include <mutex>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "plugin/comm/backend_registry.h"

namespace ddpx::comm {
namespace {

// The group registered under `name`, or null. (resolve_process_group throws
// for an unknown name in every torch version; is_process_group_registered
// is 2.15's only.)
c10::intrusive_ptr<c10d::ProcessGroup> registered(const std::string& name) {
  try {
    return c10d::resolve_process_group(name);
  } catch (const std::exception&) {
    return {};
  }
}

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> world() {
  if (detect_launcher() == Launcher::Mpi && detail::find_backend("ddpx_mpi") != nullptr) {
    static std::mutex mu;
    // Deliberately leaked: destroying a backend during static destruction
    // would race MPI's own exit handler (mpi_env.h finalises MPI at exit).
    static auto* pg = new c10::intrusive_ptr<c10d::ProcessGroup>();
    std::lock_guard<std::mutex> lock(mu);
    if (!*pg) {
      MakeOptions o;
      o.name = "ddpx_codec_world";
      *pg = make("ddpx_mpi", o);  // collective: every rank's first call gets here together
    }
    return *pg;
  }
  // torch.distributed names its default group "0" (_process_group_name with a
  // fresh group count) and registers it with c10d.
  auto group = registered("0");
  TORCH_CHECK(group,
              "ddpx: group \"\" means the world group, but this process was not started by "
              "mpirun and torch.distributed has no default group; call "
              "torch.distributed.init_process_group() first or pass a registered group name");
  return group;
}

c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(const std::string& name) {
  if (name.empty()) return world();
  auto group = registered(name);
  TORCH_CHECK(group, "ddpx: group '", name,
              "' is not a registered process group (torch.distributed registers each group "
              "under its group_name)");
  return group;
}

}  // namespace ddpx::comm
