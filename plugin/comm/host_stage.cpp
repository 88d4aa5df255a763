#include "plugin/comm/host_stage.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/util/Exception.h>

#include <deque>
#include <optional>
#include <unordered_map>
#include <vector>

namespace ddpx::comm::detail {

CopyFn async_copy() {
  return [](const at::Tensor& dst, const at::Tensor& src) { dst.copy_(src, /*non_blocking=*/true); };
}

int64_t stage_chunk_count(int64_t numel, int64_t chunk) {
  TORCH_CHECK(chunk > 0, "staging chunk must be positive, got ", chunk);
  if (numel <= chunk) return 1;
  const int64_t whole = numel / chunk, tail = numel - whole * chunk;
  // A tail under 1/8 of a chunk rides with the chunk before it: a collective
  // of its own costs its fixed time (0.25-3 ms for Gloo on the H200's VM,
  // bench_results/gpu/2026-11-30-h200) for at most 1/8 of a chunk's copy.
  return tail == 0 || tail * 8 < chunk ? whole : whole + 1;
}

int64_t stage_chunk_length(int64_t numel, int64_t chunk, int64_t k) {
  const int64_t chunks = stage_chunk_count(numel, chunk);
  TORCH_INTERNAL_ASSERT(k >= 0 && k < chunks);
  return k + 1 < chunks ? chunk : numel - k * chunk;
}

void staged_reduce(const c10::Stream& stream, const at::Tensor& dev, const at::Tensor& host,
                   int64_t chunk, const CopyFn& copy, const StartReduceFn& start,
                   int in_flight) {
  TORCH_INTERNAL_ASSERT(dev.is_contiguous() && host.is_contiguous() && host.is_cpu());
  TORCH_INTERNAL_ASSERT(host.scalar_type() == dev.scalar_type() && host.numel() >= dev.numel());
  TORCH_INTERNAL_ASSERT(in_flight >= 1);
  const int64_t numel = dev.numel(), chunks = stage_chunk_count(numel, chunk);
  auto piece = [&](const at::Tensor& t, int64_t k) {
    return t.view({-1}).narrow(0, k * chunk, stage_chunk_length(numel, chunk, k));
  };
  std::vector<c10::Event> out;
  out.reserve(static_cast<size_t>(chunks));
  for (int64_t k = 0; k < chunks; ++k) {
    copy(piece(host, k), piece(dev, k));
    out.emplace_back(stream.device_type());
    out.back().record(stream);
  }
  // Started and not yet waited for, oldest first: (chunk, its wait).
  std::deque<std::pair<int64_t, std::function<void()>>> started;
  auto finish_oldest = [&] {
    auto [k, wait] = std::move(started.front());
    started.pop_front();
    wait();
    copy(piece(dev, k), piece(host, k));
  };
  try {
    for (int64_t k = 0; k < chunks; ++k) {
      out[static_cast<size_t>(k)].synchronize();
      at::Tensor h = piece(host, k);
      started.emplace_back(k, start(h));
      if (static_cast<int>(started.size()) >= in_flight) finish_oldest();
    }
    while (!started.empty()) finish_oldest();
  } catch (...) {
    for (auto& s : started) {
      try {
        s.second();
      } catch (...) {  // (the first error is the one reported)
      }
    }
    throw;
  }
}

at::Tensor thread_host_buffer(const at::Tensor& like, const c10::Stream& stream) {
  struct Buffer {
    at::Tensor bytes;  // pinned
    std::optional<c10::Stream> last;
  };
  thread_local std::unordered_map<c10::Device, Buffer> buffers;
  const int64_t bytes = like.numel() * static_cast<int64_t>(like.element_size());
  Buffer& entry = buffers[like.device()];
  if (entry.last && *entry.last != stream) {
    c10::Event last_use(stream.device_type());
    last_use.record(*entry.last);
    last_use.block(stream);
  }
  entry.last = stream;
  at::Tensor& buf = entry.bytes;
  if (!buf.defined() || buf.numel() < bytes) {
    // The old buffer goes back to the caching host allocator, which hands it
    // out again only once the copies recorded on it are done.
    buf = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(like.is_cuda()));
  }
  return buf.narrow(0, 0, bytes).view(like.scalar_type());
}

}  // namespace ddpx::comm::detail
