#include "hooks/stream_handoff.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <exception>

namespace ddpx::hooks {

c10::Stream current_stream(c10::Device d) {
  return c10::impl::VirtualGuardImpl(d.type()).getStream(d);
}

c10::Stream pool_stream(c10::Device d) {
  return c10::impl::VirtualGuardImpl(d.type()).getStreamFromGlobalPool(d);
}

void StreamFence::add(const c10::Stream& s) {
  auto it = std::find(streams_.begin(), streams_.end(), s);
  if (it == streams_.end()) {
    streams_.push_back(s);
    events_.emplace_back(s.device_type());
    events_.back().record(s);
  } else {
    events_[static_cast<size_t>(it - streams_.begin())].record(s);
  }
}

void StreamFence::block(const c10::Stream& s) const {
  for (size_t i = 0; i < events_.size(); ++i) {
    if (streams_[i] != s) events_[i].block(s);  // a stream is ordered after itself
  }
}

void StreamFence::block_current() const {
  for (size_t i = 0; i < events_.size(); ++i) {
    const c10::Stream here = current_stream(streams_[i].device());
    if (streams_[i] != here) events_[i].block(here);
  }
}

std::vector<c10::Stream> current_streams(const std::vector<c10::Device>& devices) {
  std::vector<c10::Stream> out;
  for (const auto& d : devices) {
    if (!has_streams(d)) continue;
    const bool seen =
        std::any_of(out.begin(), out.end(), [&](const c10::Stream& s) { return s.device() == d; });
    if (!seen) out.push_back(current_stream(d));
  }
  return out;
}

std::shared_ptr<const StreamFence> fence_current(const std::vector<c10::Device>& devices) {
  const auto streams = current_streams(devices);
  if (streams.empty()) return nullptr;
  auto fence = std::make_shared<StreamFence>();
  for (const auto& s : streams) fence->add(s);
  return fence;
}

std::vector<c10::Storage> storages_of(const at::Tensor& t) {
  if (!t.defined()) return {};
  if (t.is_sparse()) return {t._indices().storage(), t._values().storage()};
  return {t.storage()};
}

void mark_in_use(const at::Tensor& t, const c10::Stream& s) {
  if (!t.defined() || !has_streams(t.device())) return;
  c10::impl::VirtualGuardImpl impl(s.device_type());
  for (const auto& st : storages_of(t)) impl.recordDataPtrOnStream(st.data_ptr(), s);
}

void mark_in_use_here(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) {
    if (t.defined() && has_streams(t.device())) mark_in_use(t, current_stream(t.device()));
  }
}

void run_on_stream(const c10::Stream& comm, const StreamFence& before,
                   const std::vector<c10::Storage>& keep, const std::function<void()>& fn,
                   StreamFence* done) {
  before.block(comm);
  std::exception_ptr error;
  {
    c10::StreamGuard guard(comm);
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
  }
  c10::impl::VirtualGuardImpl impl(comm.device_type());
  for (const auto& s : keep) impl.recordDataPtrOnStream(s.data_ptr(), comm);
  done->add(comm);
  if (error) std::rethrow_exception(error);
}

}  // namespace ddpx::hooks
