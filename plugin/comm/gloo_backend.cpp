// Gloo through torch's own ProcessGroupGloo (the wheel carries the code but
// not gloo's headers; Debian's libgloo-dev provides the declarations its
// header needs: gloo objects appear there only behind pointers).
#define USE_C10D_GLOO 1
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "plugin/comm/backend_registry.h"

namespace ddpx::comm::detail {
namespace {

BackendPtr create_gloo(const BackendArgs& a) {
  auto opts = c10d::ProcessGroupGloo::Options::create();
  opts->timeout = a.timeout;
  opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  return c10::make_intrusive<c10d::ProcessGroupGloo>(a.store, a.rank, a.size, opts);
}

const bool registered = register_backend(
    {"gloo", c10d::ProcessGroup::BackendType::GLOO, /*needs_store=*/true, &create_gloo});

}  // namespace
}  // namespace ddpx::comm::detail
