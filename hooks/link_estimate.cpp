#include "hooks/link_estimate.h"

#include <algorithm>

namespace ddpx::hooks {

namespace {
constexpr double kDecay = 0.7;  // weight left to the steps before this one
constexpr size_t kTrips = 8;
}  // namespace

double LinkEstimate::launch_us() const {
  return trips_.empty() ? kDefaultLaunchUs : *std::min_element(trips_.begin(), trips_.end());
}

void LinkEstimate::add_round_trip(double us) {
  if (us <= 0) return;
  trips_.push_back(us);
  if (trips_.size() > kTrips) trips_.pop_front();
}

void LinkEstimate::add_step(const std::vector<std::pair<double, double>>& samples) {
  double bytes = 0, busy = 0;
  for (const auto& [b, us] : samples) {
    if (b <= 0 || us <= 0) continue;
    bytes += b;
    // The fixed cost is not bandwidth; never more than half a bucket's time
    // (a round trip measured on a quiet step, a bucket on a busy one).
    busy += std::max(us - launch_us(), 0.5 * us);
  }
  if (bytes <= 0) return;
  bytes_ = kDecay * bytes_ + bytes;
  busy_ = kDecay * busy_ + busy;
}

std::vector<double> link_busy_us(std::vector<LinkSpan> spans, size_t buckets) {
  std::stable_sort(spans.begin(), spans.end(),
                   [](const LinkSpan& x, const LinkSpan& y) { return x.end_us < y.end_us; });
  std::vector<double> busy(buckets, -1);
  double free_at = 0;
  for (const auto& s : spans) {
    busy[s.bucket] = std::max(busy[s.bucket], 0.0) + s.end_us - std::max(s.begin_us, free_at);
    free_at = std::max(free_at, s.end_us);
  }
  return busy;
}

void UseRate::observe(const std::vector<char>& used_anywhere) {
  const double a = std::max(alpha_, 1.0 / ++steps_);
  for (size_t p = 0; p < rate_.size(); ++p) {
    rate_[p] += a * ((used_anywhere[p] ? 1.0 : 0.0) - rate_[p]);
  }
}

}  // namespace ddpx::hooks
