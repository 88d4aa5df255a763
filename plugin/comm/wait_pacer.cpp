#include "plugin/comm/wait_pacer.h"

#include <algorithm>

namespace ddpx::comm::detail {

std::chrono::nanoseconds WaitPacer::after_test(Clock::time_point t0, Clock::time_point t1) {
  if (t1 - t0 >= kWorkingTest) {
    if (in_window_) ++hits_;
    in_window_ = true;
    last_work_ = t1;
  }
  if (t1 - start_ < kSpinFirst || (spinning_pays() && t1 - last_work_ < kSpinAfterWork)) {
    return std::chrono::nanoseconds(0);
  }
  if (in_window_) {
    ++misses_;
    in_window_ = false;
  }
  const auto waited = std::chrono::duration_cast<us>(t1 - start_);
  const auto cap = spinning_pays() && t1 - last_work_ < kQuiet ? kBusyNap : kQuietNap;
  return std::clamp(waited / 16, us(10), cap);
}

}  // namespace ddpx::comm::detail
