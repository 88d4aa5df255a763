#include "plugin/ps/gate.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace ddpx::ps::detail {

Gate::Gate(Consistency c, int workers, bool deterministic)
    : c_(c),
      deterministic_(deterministic),
      live_(workers, true),
      base_(workers, 0),
      given_(workers, false),
      done_(workers, 0),
      in_flight_(workers, false) {}

void Gate::offer(const Ticket& t) {
  TORCH_INTERNAL_ASSERT(t.worker >= 0 && t.worker < static_cast<int>(live_.size()));
  base_[t.worker] = t.base;
  held_.push_back(t);
}

void Gate::gave(int worker, int64_t version) {
  base_[worker] = version;
  given_[worker] = true;
  in_flight_[worker] = true;
}

void Gate::finished(int worker) {
  ++done_[worker];
  in_flight_[worker] = false;
}

void Gate::gone(int worker) { live_[worker] = false; }

int Gate::live_count() const {
  return static_cast<int>(std::count(live_.begin(), live_.end(), true));
}

int64_t Gate::held() const { return static_cast<int64_t>(held_.size()); }

Decision Gate::take(size_t i) {
  Decision d;
  d.apply.push_back(held_[i]);
  held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(i));
  return d;
}

std::optional<Decision> Gate::next(int64_t version) {
  if (held_.empty()) return std::nullopt;
  switch (c_.kind) {
    case Consistency::Kind::Async:
      return next_async();
    case Consistency::Kind::Ssp:
      // The replies keep the clock bound (may_start). With S >= N - 1 the
      // pushes are also held so that no applied gradient is more than S
      // versions stale; below that no order can promise it (N gradients
      // computed at once are applied one after another), and they go as
      // they come.
      return c_.bound >= static_cast<int64_t>(live_.size()) - 1 ? next_ssp(version) : next_async();
    case Consistency::Kind::Sync:
      return next_sync(version);
  }
  return std::nullopt;
}

std::optional<Decision> Gate::next_async() {
  if (!deterministic_) return take(0);
  // Round robin over the workers: it is worker cursor_'s turn; a worker that
  // is gone and has nothing held loses its turns. Each worker's pushes arrive
  // in its own order (MPI keeps one sender's messages in order).
  // Nothing is applied before every live worker has its first parameters:
  // otherwise a slow first pull would be answered with a later version.
  const int n = static_cast<int>(live_.size());
  for (int w = 0; w < n; ++w) {
    if (live_[w] && !given_[w]) return std::nullopt;
  }
  for (int tries = 0; tries < n; ++tries) {
    for (size_t i = 0; i < held_.size(); ++i) {
      if (held_[i].worker == cursor_) {
        cursor_ = (cursor_ + 1) % n;
        return take(i);
      }
    }
    if (live_[cursor_]) return std::nullopt;  // its push is still on the way
    cursor_ = (cursor_ + 1) % n;
  }
  return std::nullopt;
}

std::optional<Decision> Gate::next_ssp(int64_t version) {
  // Every live worker holds one gradient (computing, or held here) with base
  // b_w, and each is applied at its own version. A held push of u may go if,
  // after it, the others can still all be applied in time: sorted by base,
  // the i-th would be applied at version + 1 + i at the earliest, so
  // version + 1 + i - b_(i) <= S for every i. Trying the oldest held push
  // first keeps that true forever: the oldest gradient can always go (the
  // others keep their slots), so nothing waits for ever. Checking only
  // version + 1 - b_w <= S is not enough: two workers still on the same old
  // base both need a slot, and one of them would end up S + 1 stale.
  std::vector<size_t> order(held_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return held_[a].base < held_[b].base; });
  std::vector<int64_t> others;
  for (size_t i : order) {
    const int u = held_[i].worker;
    others.clear();
    for (size_t w = 0; w < live_.size(); ++w) {
      // (A worker whose reply the clock bound holds has no gradient in
      // flight: it gets the version of that moment when it is let go.)
      if (static_cast<int>(w) != u && live_[w] && in_flight_[w]) others.push_back(base_[w]);
    }
    std::sort(others.begin(), others.end());
    bool ok = true;
    for (size_t j = 0; j < others.size() && ok; ++j) {
      ok = version + 1 + static_cast<int64_t>(j) - others[j] <= c_.bound;
    }
    if (ok) return take(i);
  }
  return std::nullopt;
}

bool Gate::may_start(int worker) const {
  if (c_.kind != Consistency::Kind::Ssp) return true;
  // Stale synchronous parallel (Ho et al. 2013): the clock bound. The
  // slowest live worker can always go (its gap is 0), so nothing waits for
  // ever; a worker that is gone bounds nobody.
  int64_t slowest = done_[worker];
  for (size_t w = 0; w < live_.size(); ++w) {
    if (live_[w]) slowest = std::min(slowest, done_[w]);
  }
  return done_[worker] - slowest <= c_.bound;
}

std::optional<Decision> Gate::next_sync(int64_t version) {
  Decision d;
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->base < version) {
      d.drop.push_back(*it);
      it = held_.erase(it);
    } else {
      ++it;
    }
  }
  const int64_t live = live_count();
  const int64_t quorum =
      std::max<int64_t>(1, c_.quorum > 0 ? std::min<int64_t>(c_.quorum, live) : live);
  if (static_cast<int64_t>(held_.size()) >= quorum) {
    // Summed in worker order, whatever the arrival order: the same bits every run.
    d.apply.assign(held_.begin(), held_.begin() + quorum);
    held_.erase(held_.begin(), held_.begin() + quorum);
    std::sort(d.apply.begin(), d.apply.end(),
              [](const Ticket& a, const Ticket& b) { return a.worker < b.worker; });
  }
  if (d.apply.empty() && d.drop.empty()) return std::nullopt;
  return d;
}

}  // namespace ddpx::ps::detail
