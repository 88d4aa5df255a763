#include "hooks/reduce_fn.h"

#include <c10/util/Exception.h>
#include <ddpx/codec.h>

#include <memory>

namespace ddpx::hooks {

ReduceFn make_reduce_fn(const std::string& codec) {
  if (codec != "none") {
    // Lossy codecs keep error-feedback state per bucket key inside the codec.
    std::shared_ptr<comm::Codec> c = comm::make_codec(codec);
    return [c](at::Tensor& flat, const std::string& key, c10d::ProcessGroup& pg) {
      flat.copy_(c->allreduce_mean(flat, key, pg));
    };
  }
  return [](at::Tensor& flat, const std::string&, c10d::ProcessGroup& pg) {
    // Divide before summing: a low-precision bucket cannot overflow, and the
    // result is the same on every rank bit for bit (all receive one sum).
    // (One rank: nothing to average, and no pass over the bucket.)
    if (at::isFloatingType(flat.scalar_type()) && pg.getSize() > 1) flat.div_(pg.getSize());
    std::vector<at::Tensor> t{flat};
    pg.allreduce(t)->wait();
  };
}

}  // namespace ddpx::hooks
