#pragma once
// Stream ordering between backward and GradSync's channel threads, for
// buckets on a device with streams (CUDA). Device work is asynchronous: when
// a gradient hook returns, the kernels that produced the gradient (and the
// hook's copy into its slot) may still be queued on the hook's current
// stream, and a channel thread's current stream knows nothing of them. So a
// launch records events on the streams that wrote the bucket, the channel
// runs the reduction on a stream of its own after them (collectives order
// their own streams after the caller's current one), and the step's end
// makes the consumer's stream (the caller of backward, where the optimizer
// runs) wait for the reduction. CPU buckets need none of this: every call is
// a no-op there, without allocating.
//
// Written against c10's device-generic Stream/Event interface, so it needs no
// CUDA headers and the tests drive it with a recording guard implementation.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>

#include <functional>
#include <memory>
#include <vector>

namespace ddpx::hooks {

// Does `d` have streams to order (anything but the CPU)?
inline bool has_streams(c10::Device d) { return d.type() != c10::DeviceType::CPU; }

// The calling thread's current stream on device `d` (has_streams(d)).
c10::Stream current_stream(c10::Device d);

// A stream from the device's pool, for a channel's reductions on `d`.
c10::Stream pool_stream(c10::Device d);

// Events recorded on streams, one per distinct stream: "the work queued on
// these streams so far".
class StreamFence {
 public:
  // Records an event on `s` now (again, if `s` is in the fence already: the
  // later version covers the earlier).
  void add(const c10::Stream& s);
  // Makes `s` wait for every event, without blocking the host.
  void block(const c10::Stream& s) const;
  // Makes the calling thread's current stream on each event's device wait
  // for it (a reader that does not know which stream the writer used).
  void block_current() const;
  bool empty() const { return events_.empty(); }
  size_t size() const { return events_.size(); }

 private:
  std::vector<c10::Stream> streams_;
  std::vector<c10::Event> events_;
};

// The calling thread's current stream on each device of `devices` that has
// streams, once per device: what another thread must queue on to be
// ordered with this one's work (GradSync's worker, completing a step
// backward's caller will consume).
std::vector<c10::Stream> current_streams(const std::vector<c10::Device>& devices);

// A fence of the work queued so far on those streams (what a gate opened
// now must make its reader wait for); null when no device has streams.
std::shared_ptr<const StreamFence> fence_current(const std::vector<c10::Device>& devices);

// The storages holding `t`'s data: a sparse tensor's indices and values, a
// strided tensor's one; none for an undefined tensor.
std::vector<c10::Storage> storages_of(const at::Tensor& t);

// Marks `t`'s memory (storages_of) in use on stream `s`, where it was not
// allocated, for the caching allocator. A no-op for an undefined tensor or
// one without streams.
void mark_in_use(const at::Tensor& t, const c10::Stream& s);

// Each tensor's memory in use on the calling thread's current stream of its
// device: for memory made on another stream that this thread's queued work
// still reads, about to be freed (a re-plan's old buckets, GradSync's at its
// end). Without it the block would go back to the stream it was made on at
// once, and work there could overwrite it before this stream's reads ran.
void mark_in_use_here(const std::vector<at::Tensor>& ts);

// Runs `fn` with `comm` as its device's current stream, after the work in
// `before`, and records in `*done` the work fn queued on `comm`. `keep`:
// storages allocated on other streams that fn's work uses, marked in use on
// `comm` so the caching allocator does not hand them out again before that
// work is done. Both also when fn throws (then rethrown): what it queued
// before failing still runs, and the failed step's consumer must wait for it.
void run_on_stream(const c10::Stream& comm, const StreamFence& before,
                   const std::vector<c10::Storage>& keep, const std::function<void()>& fn,
                   StreamFence* done);

}  // namespace ddpx::hooks
