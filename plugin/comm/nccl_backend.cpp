// NCCL through torch's own ProcessGroupNCCL (compiled only with CUDA).
#define USE_C10D_NCCL 1
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "plugin/comm/backend_registry.h"

namespace ddpx::comm::detail {
namespace {

BackendPtr create_nccl(const BackendArgs& a) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = a.timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(a.store, a.rank, a.size, opts);
}

const bool registered = register_backend(
    {"nccl", c10d::ProcessGroup::BackendType::NCCL, /*needs_store=*/true, &create_nccl});

}  // namespace
}  // namespace ddpx::comm::detail
