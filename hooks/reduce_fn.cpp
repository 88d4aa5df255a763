#include "hooks/reduce_fn.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <memory>

#include "plugin/comm/codec_util.h"

namespace ddpx::hooks {

ReduceFn make_reduce_fn(const std::string& codec, WireStatsFn* stats,
                        std::shared_ptr<comm::Codec>* lossy, int64_t stage_chunk_bytes) {
  if (lossy) lossy->reset();  // "none" keeps no state
  if (codec != "none") {
    // Lossy codecs keep error-feedback state per bucket key inside the codec.
    std::shared_ptr<comm::Codec> c = comm::make_codec(codec);
    if (stats) *stats = [c] { return c->stats(); };
    if (lossy) *lossy = c;
    return [c](at::Tensor& flat, const std::string& key, const Shapes& shapes,
               const std::vector<std::string>& part_keys, c10d::ProcessGroup& pg) {
      flat.copy_(c->allreduce_mean_packed(flat, shapes, key, pg, part_keys));
    };
  }
  struct Counters {
    std::atomic<int64_t> calls{0}, sent{0}, raw{0};
  };
  auto n = std::make_shared<Counters>();
  if (stats) *stats = [n] { return comm::CodecStats{n->calls, n->sent, n->raw}; };
  return [n, stage_chunk_bytes](at::Tensor& flat, const std::string&, const Shapes&,
                                const std::vector<std::string>&, c10d::ProcessGroup& pg) {
    // Divide before summing: a low-precision bucket cannot overflow, and the
    // result is the same on every rank bit for bit (all receive one sum).
    // (One rank: nothing to average, and no pass over the bucket.)
    if (at::isFloatingType(flat.scalar_type()) && pg.getSize() > 1) flat.div_(pg.getSize());
    comm::detail::allreduce_sum(pg, flat, stage_chunk_bytes);
    n->calls += 1;
    n->sent += static_cast<int64_t>(flat.nbytes());
    n->raw += 4 * flat.numel();
  };
}

}  // namespace ddpx::hooks
