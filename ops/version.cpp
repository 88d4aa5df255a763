// ddpx::version() -> str: lets a TorchScript program or a Python user check
// which plugin build is loaded.
#include <ddpx/ops.h>
#include <torch/library.h>

#ifndef DDPX_VERSION_STRING
#define DDPX_VERSION_STRING "0.0.0"
#endif

namespace ddpx {

std::string version() { return DDPX_VERSION_STRING; }

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  m.def("version() -> str", [] { return version(); });
}

}  // namespace ddpx
