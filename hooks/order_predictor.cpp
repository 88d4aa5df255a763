#include "hooks/order_predictor.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>

namespace ddpx::hooks {

OrderPredictor::OrderPredictor(int n, double alpha)
    : alpha_(alpha), position_ema_(n), used_ema_(n, 1.0), miss_ema_(n, 0.0) {
  for (int i = 0; i < n; ++i) position_ema_[i] = n > 1 ? 1.0 - double(i) / (n - 1) : 0.0;
}

namespace {

// The last order with `arrival` in the places of the parameters not excused
// (in arrival's order), the excused ones where they were; arrivals beyond
// those places go at the end. Excused ones never seen are left out.
std::vector<int> merge_excused(const std::vector<int>& last, const std::vector<int>& arrival,
                               const std::vector<char>& excused) {
  std::vector<int> out;
  out.reserve(last.size() + arrival.size());
  size_t next = 0;
  for (int p : last) {
    if (excused[p]) {
      out.push_back(p);
    } else if (next < arrival.size()) {
      out.push_back(arrival[next++]);
    }
  }
  out.insert(out.end(), arrival.begin() + static_cast<std::ptrdiff_t>(next), arrival.end());
  return out;
}

}  // namespace

void OrderPredictor::observe(const std::vector<int>& arrival, const std::vector<char>* missed,
                             const std::vector<double>* arrival_us,
                             const std::vector<char>* excused) {
  const int n = static_cast<int>(position_ema_.size());
  TORCH_INTERNAL_ASSERT(!missed || static_cast<int>(missed->size()) == n);
  TORCH_INTERNAL_ASSERT(!excused || static_cast<int>(excused->size()) == n);
  std::vector<double> pos(n, -1.0);
  const int m = static_cast<int>(arrival.size());
  for (int k = 0; k < m; ++k) {
    TORCH_INTERNAL_ASSERT(arrival[k] >= 0 && arrival[k] < n);
    pos[arrival[k]] = m > 1 ? double(k) / (m - 1) : 0.0;
  }
  // The first observation replaces the guess outright; later ones blend in.
  const double a = steps_ == 0 ? 1.0 : alpha_;
  const double am = steps_ == 0 ? 1.0 : kMissAlpha;
  const auto late_before = late_set();
  for (int i = 0; i < n; ++i) {
    if (excused && (*excused)[i]) continue;  // dropped by the step's pattern: no news
    const bool used = pos[i] >= 0;
    used_ema_[i] = (1 - a) * used_ema_[i] + a * (used ? 1.0 : 0.0);
    const bool miss = missed ? (*missed)[i] != 0 : !used;
    miss_ema_[i] = (1 - am) * miss_ema_[i] + am * (miss ? 1.0 : 0.0);
    if (used) position_ema_[i] = (1 - a) * position_ema_[i] + a * pos[i];
  }
  if (arrival_us) {
    TORCH_INTERNAL_ASSERT(static_cast<int>(arrival_us->size()) == n);
    if (time_ema_.empty()) time_ema_.assign(n, -1.0);
    for (int i = 0; i < n; ++i) {
      const double t = (*arrival_us)[i];
      if (t < 0) continue;  // unused this step: keeps its time
      time_ema_[i] = time_ema_[i] < 0 ? t : (1 - alpha_) * time_ema_[i] + alpha_ * t;
    }
    ++timed_steps_;
  }
  // Stability is of the reliable parameters' order: late ones go to late
  // buckets whatever their order, and an alternating pair of experts never
  // repeats the raw one.
  const std::vector<int> order = excused ? merge_excused(last_order_, arrival, *excused) : arrival;
  std::vector<int> reliable;
  for (int p : order) {
    if (!late(p)) reliable.push_back(p);
  }
  stable_steps_ = steps_ > 0 && reliable == last_reliable_ ? stable_steps_ + 1 : 0;
  late_stable_steps_ = late_set() == late_before ? late_stable_steps_ + 1 : 0;
  last_order_ = order;
  last_reliable_ = std::move(reliable);
  ++steps_;
}

std::vector<char> OrderPredictor::late_set() const {
  std::vector<char> out(miss_ema_.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = late(static_cast<int>(i)) ? 1 : 0;
  return out;
}

std::vector<int> OrderPredictor::predicted_order(bool late_last) const {
  if (!late_last && !last_order_.empty()) {
    // The reliable ones at their place in the last step's order, the rest at
    // their average position: the same scale (0 first .. 1 last).
    const int m = static_cast<int>(last_order_.size());
    std::vector<std::pair<double, int>> keyed;
    std::vector<char> placed(position_ema_.size(), 0);
    for (int k = 0; k < m; ++k) {
      const int p = last_order_[k];
      if (late(p)) continue;
      keyed.emplace_back(m > 1 ? double(k) / (m - 1) : 0.0, p);
      placed[p] = 1;
    }
    for (int i = 0; i < static_cast<int>(position_ema_.size()); ++i) {
      if (!placed[i]) keyed.emplace_back(position_ema_[i], i);
    }
    // Stable: a tie keeps the reliable one first, then index order.
    std::stable_sort(keyed.begin(), keyed.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<int> order;
    for (const auto& [key, p] : keyed) order.push_back(p);
    return order;
  }
  // Reliable parameters were all used last step: in that step's order.
  std::vector<int> order;
  std::vector<char> placed(position_ema_.size(), 0);
  for (int p : last_order_) {
    if (!late(p)) {
      order.push_back(p);
      placed[p] = 1;
    }
  }
  std::vector<int> rest;
  for (int i = 0; i < static_cast<int>(position_ema_.size()); ++i) {
    if (!placed[i]) rest.push_back(i);
  }
  // Then the rest (before any observation: everything, in reverse
  // registration order), reliable before late, by average position. Within
  // the late buckets, which launch together at the end, whether a parameter
  // was used last step does not matter, and leaving it out keeps an
  // alternating pattern's prediction fixed. Stable: ties keep reverse
  // registration order (index), so equal scores never reorder between calls.
  std::stable_sort(rest.begin(), rest.end(), [this](int a, int b) {
    const bool la = late(a), lb = late(b);
    if (la != lb) return lb;
    if (position_ema_[a] != position_ema_[b]) return position_ema_[a] < position_ema_[b];
    return a > b;
  });
  order.insert(order.end(), rest.begin(), rest.end());
  return order;
}

std::vector<double> OrderPredictor::state() const {
  std::vector<double> s = position_ema_;
  s.insert(s.end(), used_ema_.begin(), used_ema_.end());
  s.insert(s.end(), miss_ema_.begin(), miss_ema_.end());
  return s;
}

void OrderPredictor::load_state(const std::vector<double>& s, int steps) {
  const auto n = position_ema_.size();
  TORCH_CHECK(s.size() == 3 * n || s.size() == 2 * n, "order predictor state has ", s.size(),
              " values, expected ", 3 * n);
  std::copy(s.begin(), s.begin() + n, position_ema_.begin());
  std::copy(s.begin() + n, s.begin() + 2 * n, used_ema_.begin());
  if (s.size() == 3 * n) {
    std::copy(s.begin() + 2 * n, s.end(), miss_ema_.begin());
  } else {
    std::fill(miss_ema_.begin(), miss_ema_.end(), 0.0);
  }
  steps_ = steps;
  last_order_.clear();  // the next step's order is taken as it comes
  last_reliable_.clear();
  time_ema_.clear();
  timed_steps_ = 0;
  stable_steps_ = 0;
  late_stable_steps_ = 0;
}

}  // namespace ddpx::hooks
