#include "hooks/reduce_fn.h"

#include <c10/util/Exception.h>

namespace ddpx::hooks {

ReduceFn make_reduce_fn(const std::string& codec) {
  TORCH_CHECK(codec == "none", "GradSync: codec '", codec,
              "' is not available in this build; valid: none");
  return [](at::Tensor& flat, const std::string&, c10d::ProcessGroup& pg) {
    // Divide before summing: a low-precision bucket cannot overflow, and the
    // result is the same on every rank bit for bit (all receive one sum).
    if (at::isFloatingType(flat.scalar_type())) flat.div_(pg.getSize());
    std::vector<at::Tensor> t{flat};
    pg.allreduce(t)->wait();
  };
}

}  // namespace ddpx::hooks
