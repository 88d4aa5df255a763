// Built without MPI: there is no parameter server.
#include <c10/util/Exception.h>

#include "plugin/trainer/trainer.h"

namespace ddpx::trainer {

std::string run_ps(const Options&) {
  TORCH_CHECK(false, "ddpx-train: --mode ps needs MPI; this build has DDPX_WITH_MPI=OFF");
}

}  // namespace ddpx::trainer
