// Gloo through torch's own ProcessGroupGloo (the wheel carries the code but
// not gloo's headers; Debian's libgloo-dev provides the declarations its
// header needs: gloo objects appear there only behind pointers).
#define USE_C10D_GLOO 1
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <c10/util/env.h>

#include <sstream>
#include <string>

#include "plugin/comm/backend_registry.h"

namespace ddpx::comm::detail {
namespace {

BackendPtr create_gloo(const BackendArgs& a) {
  auto opts = c10d::ProcessGroupGloo::Options::create();
  opts->timeout = a.timeout;
  // As torch.distributed does: GLOO_SOCKET_IFNAME picks the interface(s),
  // comma-separated, e.g. on hosts whose name resolves to the wrong network.
  if (auto ifnames = c10::utils::get_env("GLOO_SOCKET_IFNAME"); ifnames && !ifnames->empty()) {
    std::stringstream ss(*ifnames);
    std::string ifname;
    while (std::getline(ss, ifname, ',')) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    }
  } else {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  return c10::make_intrusive<c10d::ProcessGroupGloo>(a.store, a.rank, a.size, opts);
}

const bool registered = register_backend(
    {"gloo", c10d::ProcessGroup::BackendType::GLOO, /*needs_store=*/true, &create_gloo,
     /*host_only=*/[] { return true; }});

}  // namespace
}  // namespace ddpx::comm::detail
