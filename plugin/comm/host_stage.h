#pragma once
// A device tensor reduced through host memory, for backends that reduce host
// memory only (Gloo's CPU algorithms; ddpx_mpi over an MPI that is not
// CUDA-aware). Issue 60: PyTorch's Gloo group, handed a CUDA bucket, copies
// it to pinned memory on a side stream, reduces it, copies it back: the three
// phases one after another for the whole bucket.
//
// Here the tensor is cut into chunks. Every chunk's copy out (into a pinned
// host buffer, asynchronous) is queued at once on the caller's stream, each
// followed by an event; the calling thread waits for chunk k's event alone,
// starts chunk k's reduction on the host (two at a time on the wire) and,
// once it is done, queues its copy back. So chunk k is on the wire while
// later chunks still come out and earlier ones go back. The
// callers run it off the thread that runs backward: GradSync on a channel
// thread (the consumer's stream waits on the channel stream's fence), DDP's
// comm hooks (ddpx.distributed) on their worker thread and a stream of its
// own; the codec "none" (allreduce_sum) serves both.
//
// The host buffer is reused: the next reduction on the same thread and
// device queues its copies out on the same stream, after this one's copies
// back, and reads a chunk only after its own event.
//
// Device-generic (c10::Stream and c10::Event; the copies through CopyFn), so
// tests/cpp/test_stream_handoff.cpp runs it on a simulated device.
#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <functional>

namespace ddpx::comm::detail {

// Chunk size of the staged path where the caller names none (the codec
// "none" of ddpx::compressed_allreduce and the DDP comm hooks); GradSync's is
// GradSyncOptions::stage_chunk_bytes, of the same default. 4 MiB: ~1 ms of
// copy at PCIe 4's bandwidth and a few ms on a 10 Gbit/s link, so a bucket of
// tens of MB overlaps its copies with the wire while a chunk's collective
// keeps its fixed cost small.
constexpr int64_t kStageChunkBytes = int64_t{4} << 20;

// An asynchronous copy queued on the calling thread's current stream of the
// device involved.
using CopyFn = std::function<void(const at::Tensor& dst, const at::Tensor& src)>;

// dst.copy_(src, /*non_blocking=*/true): asynchronous between a device and
// pinned host memory.
CopyFn async_copy();

// How many chunks cover `numel` elements (at least one): chunks of `chunk`
// elements, the last one longer by a tail under chunk / 8, which is not
// worth a collective of its own.
int64_t stage_chunk_count(int64_t numel, int64_t chunk);

// The length of chunk k of those (k * chunk is where it starts).
int64_t stage_chunk_length(int64_t numel, int64_t chunk, int64_t k);

// Starts a chunk's reduction (in place, on the host copy) and returns the
// wait for it: the chunk is reduced, and may be copied back, once the wait
// returns.
using StartReduceFn = std::function<std::function<void()>(at::Tensor& chunk)>;

// Chunks on the wire at once: two, as PyTorch's Gloo group runs two
// collectives at a time on its two threads (DDP has two buckets in flight
// that way). A collective's fixed cost -- 0.25-3 ms for Gloo on the H200's VM
// (bench_results/gpu/2026-11-30-h200) -- then overlaps the next chunk's
// instead of adding to it. Backends that run one collective at a time
// (ddpx_mpi) take them in the order started, as every rank starts them.
constexpr int kStageInFlight = 2;

// Runs `start` on the host copy of each chunk of `dev` (a contiguous device
// tensor) in order, staged through `host` (a contiguous host tensor of the
// same dtype and at least as many elements; pinned, for the copies to be
// asynchronous), at most `in_flight` of them started and not yet waited
// for, and copies each chunk back after its wait. `stream`: the calling
// thread's current stream of dev's device, where `copy` queues and the
// chunks' events are recorded. Returns once the last chunk is reduced and
// its copy back queued; when a start, a wait or a copy throws, every
// reduction started is waited for first (they write into `host`).
void staged_reduce(const c10::Stream& stream, const at::Tensor& dev, const at::Tensor& host,
                   int64_t chunk, const CopyFn& copy, const StartReduceFn& start,
                   int in_flight = kStageInFlight);

// The calling thread's pinned host buffer for `like`'s device, grown to hold
// like.numel() elements of its dtype (a view of it); one per thread and
// device, kept for the thread's life. `stream`: where the caller's copies
// into and out of it go (staged_reduce's). Used last on another stream,
// whose copies back out of it staged_reduce did not wait for, the buffer is
// handed out only after them: `stream` waits for that one's work so far.
at::Tensor thread_host_buffer(const at::Tensor& like, const c10::Stream& stream);

}  // namespace ddpx::comm::detail
