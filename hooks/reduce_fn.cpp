#include "hooks/reduce_fn.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <memory>

#include "hooks/host_stage.h"
#include "hooks/stream_handoff.h"
#include "plugin/comm/backend_registry.h"
#include "plugin/comm/wire_span.h"
#include "plugin/comm/work_wait.h"

namespace ddpx::hooks {

namespace {

// The group's sum of `t` in place, waited for, as one collective on the wire.
void allreduce_waited(at::Tensor& t, c10d::ProcessGroup& pg) {
  std::vector<at::Tensor> v{t};
  comm::detail::WireScope wire;
  comm::detail::wait_named(pg.allreduce(v));
}

}  // namespace

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
    // (One rank: nothing to send, so nothing to stage.)
    if (stage_chunk_bytes > 0 && flat.numel() > 0 && pg.getSize() > 1 &&
        has_streams(flat.device()) && comm::detail::stages_through_host(pg, flat.device().type())) {
      const int64_t chunk =
          std::max<int64_t>(1, stage_chunk_bytes / static_cast<int64_t>(flat.element_size()));
      if (auto* span = comm::detail::thread_wire_span()) {
        span->staged_chunks += stage_chunk_count(flat.numel(), chunk);
      }
      staged_reduce(current_stream(flat.device()), flat, thread_host_buffer(flat), chunk,
                    async_copy(), [&pg](at::Tensor& host) { allreduce_waited(host, pg); });
    } else {
      allreduce_waited(flat, pg);
    }
    n->calls += 1;
    n->sent += static_cast<int64_t>(flat.nbytes());
    n->raw += 4 * flat.numel();
  };
}

}  // namespace ddpx::hooks
