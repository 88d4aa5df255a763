#pragma once
// Marks the collectives inside a reduction ("the wire") so that a caller on
// the same thread can split a codec call it cannot see into encode
// (before the first collective), wire (first collective start to last
// collective end) and decode (after the last). GradSync's trace does this
// around each bucket; every codec's collectives go through the helpers in
// codec_util.h, which open a WireScope, so no codec needs to know.
//
// Cost when nobody records: one thread-local load and one branch per
// collective, plus RecordFunction's own check (a "ddpx::codec_wire" range
// that torch.profiler shows).
#include <ATen/record_function.h>

#include <chrono>
#include <cstdint>

namespace ddpx::comm::detail {

// Steady-clock nanoseconds of the first collective's start and the last
// one's end on this thread since the span was installed; -1 when none ran.
struct WireSpan {
  int64_t first_begin_ns = -1;
  int64_t last_end_ns = -1;
  // Chunks a device tensor was staged through host memory in
  // (host_stage.h); 0: the backend was handed the tensor itself.
  int64_t staged_chunks = 0;
};

// Installs `span` as this thread's recorder (nullptr: none); returns the
// previous one so scopes nest.
WireSpan* set_thread_wire_span(WireSpan* span);
WireSpan* thread_wire_span();

inline int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One collective: a torch.profiler range and, when a span is installed, its
// start and end in that span.
//
// payload = false marks a codec's shape agreement: a range of its own
// ("ddpx::codec_agreement") that stays out of the span, so the payload's
// encoding, done after the agreement, is not counted as wire time (in a trace
// the agreement is part of "encode").
class WireScope {
 public:
  explicit WireScope(bool payload = true)
      : rf_(at::RecordScope::USER_SCOPE), span_(payload ? thread_wire_span() : nullptr) {
    if (rf_.isActive()) rf_.before(payload ? "ddpx::codec_wire" : "ddpx::codec_agreement");
    if (span_ && span_->first_begin_ns < 0) span_->first_begin_ns = steady_ns();
  }
  ~WireScope() {
    if (span_) span_->last_end_ns = steady_ns();
  }
  WireScope(const WireScope&) = delete;
  WireScope& operator=(const WireScope&) = delete;

 private:
  at::RecordFunction rf_;
  WireSpan* span_;
};

}  // namespace ddpx::comm::detail
