// Registers ddpx_mpi with ddpx::comm::make and defines make_mpi_backend.
#include "plugin/comm/backend_registry.h"
#include "plugin/comm/mpi_backend.h"
#include "plugin/comm/mpi_util.h"

namespace ddpx::comm {

BackendPtr make_mpi_backend(const std::vector<int>& world_ranks,
                            std::chrono::milliseconds timeout) {
  return detail::MpiBackend::create(world_ranks, timeout);
}

namespace detail {
namespace {

const bool registered = register_backend(
    {"ddpx_mpi", c10d::ProcessGroup::BackendType::CUSTOM, /*needs_store=*/false,
     [](const BackendArgs& a) { return make_mpi_backend({}, a.timeout); },
     /*host_only=*/[] { return !mpi_takes_cuda_memory(Transfer::kCollective); }});

}  // namespace
}  // namespace detail
}  // namespace ddpx::comm
