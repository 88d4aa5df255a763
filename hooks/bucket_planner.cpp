#include "hooks/bucket_planner.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <tuple>

namespace ddpx::hooks {

namespace {

double bytes_of(const ParamInfo& p) {
  if (p.sparse) return 0;  // its own bucket, of rows unknown here
  return static_cast<double>(p.numel) * static_cast<double>(c10::elementSize(p.dtype));
}

double bytes_of(const BucketPlan& b) {
  return static_cast<double>(b.numel) * static_cast<double>(c10::elementSize(b.dtype));
}

// What bucket b puts on the wire: all of it, or (a late bucket) its expected
// share. (Counting a late bucket whole made the link look busy for the half
// of an alternating pair of experts that is not sent, and so never idle.)
double wire_bytes(const BucketPlan& b, const PlanTiming& timing) {
  if (!b.late || timing.late_bytes.empty()) return bytes_of(b);
  double sum = 0;
  for (int p : b.params) sum += timing.late_bytes[p];
  return sum;
}

// The link as the planner models it (plan_buckets while it plans,
// predicted_finish_us to score a plan): buckets go out one after another,
// each costing launch_us plus its bytes at the link's rate.
struct LinkModel {
  const PlanTiming* timing;
  double free_at = 0;  // when the link is done with what was sent so far
  bool rate_known() const { return timing != nullptr && timing->bytes_per_us > 0; }
  void send(const BucketPlan& b, double ready) {
    if (!rate_known()) return;
    const double bytes = wire_bytes(b, *timing);
    if (b.late && bytes <= 0) return;  // no slot used anywhere: not launched
    free_at = std::max(free_at, ready) + timing->launch_us + bytes / timing->bytes_per_us;
  }
};

// Cuts for the cheapest plan under `timing`'s model (predicted_cost_us),
// by dynamic programming over a coarse grid of `order`. The gap rule cuts at
// one idle threshold all through backward; under a link about as fast as
// backward its buckets grow toward the end (each holds what arrived while
// the last was on the wire, plus the gap), and the last, largest one is all
// exposed. The cheapest plans start small, to get the link going, and end
// small, each bucket on the wire while the next fills (many520-like, 55
// bytes/us: 12 buckets finishing 179 ms into backward, against 186 for the
// best gap plan). So the grid is fine at both ends: a segment ends after
// 1/kShare of the backward time, or of the bytes, between its start and the
// nearer end (at least 1/kFinest of the whole), and where late parameters
// start or end, since plan_buckets cuts there: ~2 kShare ln(kFinest / 2)
// segments. F[j][m] is the earliest the link is free after m buckets that
// cover segments [0, j); ~35 us at 520 parameters. A bucket never spans a
// late boundary nor, unless it is one segment, the cap; dtypes are not
// separated here (plan_buckets does that, and the plan is judged on the
// real cost). Empty: late and reliable parameters interleaved too finely
// (over kMaxSegments segments, for the cubic time, or a plan needing over
// kMaxBuckets buckets).
constexpr double kShare = 4, kFinest = 128;
constexpr size_t kMaxSegments = 128, kMaxBuckets = 64;

std::vector<char> cheapest_cuts(const std::vector<int>& order, const std::vector<ParamInfo>& params,
                                int64_t first_cap_bytes, int64_t cap_bytes,
                                const std::vector<char>& late, const PlanTiming& timing) {
  const size_t n = order.size();
  if (timing.arrival_us.size() != params.size()) return {};  // no times: nothing to plan on
  double end = 0;
  for (double a : timing.arrival_us) end = std::max(end, a);
  double total = 0;
  for (int p : order) total += bytes_of(params[p]);
  // Segments: start position, latest arrival, wire bytes, raw bytes, late.
  struct Segment {
    size_t start;
    double ready = 0, wire = 0, raw = 0;
    bool late = false;
  };
  std::vector<Segment> seg;
  double seg_first = 0, seg_before = 0, before = 0;  // bytes before a segment, before k
  for (size_t k = 0; k < n; ++k) {
    const int p = order[k];
    const bool is_late = !late.empty() && late[p];
    const double a = is_late && timing.late_at_end ? end
                     : timing.arrival_us[p] < 0    ? end
                                                   : timing.arrival_us[p];
    const double raw = bytes_of(params[p]);
    const double wire = is_late && !timing.late_bytes.empty() ? timing.late_bytes[p] : raw;
    if (seg.empty() || seg.back().late != is_late ||
        a - seg_first > std::max(std::min(seg_first, end - seg_first), end / kFinest) / kShare ||
        seg.back().raw + raw >
            std::max(std::min(seg_before, total - seg_before), total / kFinest) / kShare) {
      seg.push_back(Segment{k, a, 0, 0, is_late});
      seg_first = a;
      seg_before = before;
    }
    before += raw;
    auto& s = seg.back();
    s.ready = std::max(s.ready, a);
    s.wire += wire;
    s.raw += raw;
  }
  const size_t S = seg.size();
  if (S > kMaxSegments) return {};
  const size_t M = std::min(S, kMaxBuckets);
  constexpr double kInf = std::numeric_limits<double>::infinity();
  std::vector<double> F((S + 1) * (M + 1), kInf);
  std::vector<uint16_t> from((S + 1) * (M + 1), 0);
  auto at = [&](size_t j, size_t m) { return j * (M + 1) + m; };
  F[at(0, 0)] = 0;
  for (size_t j = 1; j <= S; ++j) {
    double ready = 0, wire = 0, raw = 0;
    for (size_t k = j; k-- > 0;) {  // the bucket is segments [k, j)
      if (k + 1 < j && seg[k].late != seg[j - 1].late) break;
      ready = std::max(ready, seg[k].ready);
      wire += seg[k].wire;
      raw += seg[k].raw;
      // A late bucket that no rank used is never launched: the link skips it.
      const double busy =
          seg[k].late && wire <= 0 ? -1 : timing.launch_us + wire / timing.bytes_per_us;
      for (size_t m = 1; m <= std::min(k + 1, M); ++m) {
        const double prev = F[at(k, m - 1)];
        if (prev == kInf) continue;
        const double cap =
            m == 1 ? static_cast<double>(first_cap_bytes) : static_cast<double>(cap_bytes);
        if (k + 1 < j && raw > cap) continue;
        const double free = busy < 0 ? prev : std::max(prev, ready) + busy;
        if (free < F[at(j, m)]) {
          F[at(j, m)] = free;
          from[at(j, m)] = static_cast<uint16_t>(k);
        }
      }
    }
  }
  size_t best_m = 1;
  for (size_t m = 1; m <= M; ++m) {
    if (F[at(S, m)] + m * timing.launch_us < F[at(S, best_m)] + best_m * timing.launch_us)
      best_m = m;
  }
  if (F[at(S, best_m)] == kInf) return {};  // more late boundaries than kMaxBuckets
  std::vector<char> cuts(n, 0);
  for (size_t j = S, m = best_m; j > 0 && m > 0; --m) {
    const size_t k = from[at(j, m)];
    if (k > 0) cuts[seg[k].start] = 1;
    j = k;
  }
  return cuts;
}

}  // namespace

std::vector<BucketPlan> plan_buckets(const std::vector<int>& order,
                                     const std::vector<ParamInfo>& params, int64_t first_cap_bytes,
                                     int64_t cap_bytes, const std::vector<char>& late,
                                     const std::vector<char>& cuts, const PlanTiming* timing,
                                     std::vector<char>* timing_cuts) {
  std::vector<BucketPlan> out;
  std::vector<std::pair<size_t, BucketPlan>> sparse;  // (position in order, bucket)
  // Per bucket: its earliest and latest predicted arrival (-1: none known).
  std::vector<double> first, ready;
  LinkModel link{timing};
  if (timing_cuts) timing_cuts->assign(order.size(), 0);
  bool late_section = false;
  int unit_section = -1;
  // One open bucket per (dtype, device); index into `out`. Integer keys: this
  // runs every step (GradSync's re-plan check), so no strings.
  std::map<std::tuple<int, int, int>, size_t> open;
  auto close_all = [&] {
    std::vector<size_t> closing;
    for (const auto& [key, b] : open) closing.push_back(b);
    std::sort(closing.begin(), closing.end());  // they launch in plan order
    for (size_t b : closing) link.send(out[b], ready[b]);
    open.clear();
  };
  for (size_t k = 0; k < order.size(); ++k) {
    const int p = order[k];
    const auto& info = params[p];
    const auto key =
        std::make_tuple(static_cast<int>(info.dtype), static_cast<int>(info.device.type()),
                        static_cast<int>(info.device.index()));
    const int64_t bytes = info.numel * static_cast<int64_t>(c10::elementSize(info.dtype));
    const bool is_late = !late.empty() && late[p];
    const double t = timing && !timing->arrival_us.empty() ? timing->arrival_us[p] : -1;
    if (!cuts.empty() && cuts[k]) close_all();
    if (info.sparse) {  // a bucket of its own, complete now; placed below
      BucketPlan b;
      b.params.push_back(p);
      b.dtype = info.dtype;
      b.device = info.device;
      b.sparse = true;
      link.send(b, t);
      sparse.emplace_back(k, std::move(b));
      continue;
    }
    if (is_late != late_section) {  // a late parameter never shares a bucket with a reliable one
      close_all();
      late_section = is_late;
    }
    if (info.unit != unit_section) {  // nor two drop units, nor a unit and the rest
      close_all();
      unit_section = info.unit;
    }
    auto it = open.find(key);
    // Timing: had the open bucket not waited for p, the link would have been
    // busy sooner. Known rate: the link sat idle, with gradients ready to go,
    // from when it was free (and the bucket had its first gradient) until p
    // arrives. (Judging only the wait for p alone, the gap since the last
    // arrival, would never cut an even stream of small gradients, whose
    // bucket then waits for the last of them.) Unknown rate: a pause in
    // backward since the bucket's last arrival. Late buckets that launch at
    // the end of backward anyway get no timing.
    double idle = 0;
    if (t >= 0 && it != open.end() && !(is_late && timing->late_at_end) &&
        ready[it->second] >= 0) {  // t >= 0: timing is given
      const size_t b = it->second;
      idle = link.rate_known() ? t - std::max(link.free_at, first[b]) : t - ready[b];
    }
    if (timing != nullptr && idle > timing->gap_us) {
      close_all();
      it = open.end();
      if (timing_cuts) (*timing_cuts)[k] = 1;
    }
    if (it != open.end()) {
      auto& b = out[it->second];
      const int64_t cap = it->second == 0 ? first_cap_bytes : cap_bytes;
      const int64_t have = b.numel * static_cast<int64_t>(c10::elementSize(b.dtype));
      if (have + bytes > cap) {
        link.send(b, ready[it->second]);
        open.erase(it);
        it = open.end();
      }
    }
    if (it == open.end()) {
      BucketPlan b;
      b.dtype = info.dtype;
      b.device = info.device;
      b.late = is_late;
      out.push_back(b);
      first.push_back(-1);
      ready.push_back(-1);
      it = open.emplace(key, out.size() - 1).first;
    }
    auto& b = out[it->second];
    b.params.push_back(p);
    b.numel += info.numel;
    if (t >= 0) {
      const size_t i = it->second;
      first[i] = first[i] < 0 ? t : std::min(first[i], t);
      ready[i] = std::max(ready[i], t);
    }
  }
  if (sparse.empty()) return out;
  // A sparse bucket launches before the first bucket that is not complete
  // when its parameter arrives (launches keep plan order): after those
  // whose last parameter comes earlier in `order`.
  std::vector<size_t> pos(params.size(), 0);
  for (size_t k = 0; k < order.size(); ++k) pos[order[k]] = k;
  std::vector<BucketPlan> merged;
  size_t s = 0;
  for (auto& b : out) {
    size_t last = 0;
    for (int p : b.params) last = std::max(last, pos[p]);
    for (; s < sparse.size() && sparse[s].first < last; ++s) {
      merged.push_back(std::move(sparse[s].second));
    }
    merged.push_back(std::move(b));
  }
  for (; s < sparse.size(); ++s) merged.push_back(std::move(sparse[s].second));
  return merged;
}

double predicted_finish_us(const std::vector<BucketPlan>& plan, const PlanTiming& timing) {
  const auto& t = timing.arrival_us;
  double end_of_backward = 0;
  for (double a : t) end_of_backward = std::max(end_of_backward, a);
  LinkModel link{&timing};
  double launch = 0;
  for (const auto& b : plan) {
    double ready = b.late && timing.late_at_end ? end_of_backward : 0;
    for (int p : b.params) ready = std::max(ready, t[p] < 0 ? end_of_backward : t[p]);
    launch = std::max(launch, ready);  // launches keep plan order
    link.send(b, launch);
  }
  return link.free_at;
}

std::vector<char> priority_tail(const std::vector<BucketPlan>& plan, const PlanTiming& timing,
                                int min_run) {
  std::vector<char> held(plan.size(), 0);
  const auto& t = timing.arrival_us;
  if (timing.bytes_per_us <= 0 || t.empty()) return held;
  double end_of_backward = 0;
  for (double a : t) end_of_backward = std::max(end_of_backward, a);
  // Each bucket's start on the link, launched in plan order as it fills.
  LinkModel link{&timing};
  double launch = 0;
  std::vector<double> start(plan.size(), 0);
  for (size_t b = 0; b < plan.size(); ++b) {
    double ready = plan[b].late && timing.late_at_end ? end_of_backward : 0;
    for (int p : plan[b].params) ready = std::max(ready, t[p] < 0 ? end_of_backward : t[p]);
    launch = std::max(launch, ready);
    start[b] = std::max(link.free_at, launch);
    link.send(plan[b], launch);
  }
  // (A launch's own cost is within the model's noise: a bucket starting that
  // close to the end starts at the end.)
  const double at_end = end_of_backward - timing.launch_us;
  int last = static_cast<int>(plan.size()) - 1;
  while (last >= 0 && plan[last].late) --last;
  int first = last + 1;
  while (first > 0 && !plan[first - 1].late && !plan[first - 1].sparse &&
         start[first - 1] >= at_end) {
    --first;
  }
  if (last - first + 1 < std::max(1, min_run)) return held;
  for (int b = first; b <= last; ++b) held[b] = 1;
  return held;
}

PrioritySplit priority_split(const std::vector<BucketPlan>& plan, const std::vector<char>& held,
                             const PlanTiming& timing, int64_t piece) {
  PrioritySplit none;
  const auto& t = timing.arrival_us;
  if (timing.bytes_per_us <= 0 || t.empty() || piece <= 0) return none;
  if (std::find(held.begin(), held.end(), 1) == held.end()) return none;
  double end_of_backward = 0;
  for (double a : t) end_of_backward = std::max(end_of_backward, a);
  LinkModel link{&timing};
  double launch = 0;
  for (size_t b = 0; b < plan.size() && !held[b]; ++b) {
    double ready = plan[b].late && timing.late_at_end ? end_of_backward : 0;
    for (int p : plan[b].params) ready = std::max(ready, t[p] < 0 ? end_of_backward : t[p]);
    launch = std::max(launch, ready);
    link.send(plan[b], launch);
    // The held run follows this bucket: is it still on the link at the end?
    if (b + 1 >= held.size() || !held[b + 1]) continue;
    if (plan[b].late || plan[b].sparse || launch >= end_of_backward) return none;
    const double left = (link.free_at - end_of_backward) * timing.bytes_per_us;
    const auto elem = static_cast<double>(c10::elementSize(plan[b].dtype));
    const auto rest = static_cast<int64_t>(std::ceil(left / elem / piece)) * piece;
    if (left <= 0 || rest >= plan[b].numel) return none;
    return PrioritySplit{static_cast<int>(b), plan[b].numel - rest};
  }
  return none;
}

std::vector<char> priority_cuts(const std::vector<BucketPlan>& plan, const std::vector<char>& held,
                                const std::vector<int>& order, const std::vector<ParamInfo>& params,
                                int pieces) {
  std::vector<char> cuts(order.size(), 0);
  std::vector<size_t> pos(params.size(), 0);
  for (size_t k = 0; k < order.size(); ++k) pos[order[k]] = k;
  double total = 0;
  for (size_t b = 0; b < plan.size(); ++b) {
    if (held[b]) total += bytes_of(plan[b]);
  }
  if (total <= 0 || pieces < 2) return cuts;
  const double piece = total / pieces;
  for (size_t b = 0; b < plan.size(); ++b) {
    if (!held[b]) continue;
    double acc = 0;
    for (int p : plan[b].params) {
      if (acc >= piece) {
        cuts[pos[p]] = 1;
        acc = 0;
      }
      acc += bytes_of(params[p]);
    }
  }
  return cuts;
}

double predicted_cost_us(const std::vector<BucketPlan>& plan, const PlanTiming& timing) {
  return predicted_finish_us(plan, timing) + static_cast<double>(plan.size()) * timing.launch_us;
}

std::vector<BucketPlan> plan_buckets_cheapest(const std::vector<int>& order,
                                              const std::vector<ParamInfo>& params,
                                              int64_t first_cap_bytes, int64_t cap_bytes,
                                              const std::vector<char>& late,
                                              const PlanTiming& timing,
                                              std::vector<char>* timing_cuts) {
  if (timing.bytes_per_us <= 0) {
    return plan_buckets(order, params, first_cap_bytes, cap_bytes, late, {}, &timing, timing_cuts);
  }
  // From no timing cuts (an infinite gap) down to the given gap: a narrower
  // gap must be strictly cheaper to win.
  std::vector<BucketPlan> best =
      plan_buckets(order, params, first_cap_bytes, cap_bytes, late, {}, nullptr, nullptr);
  double best_cost = predicted_cost_us(best, timing);
  std::vector<char> best_cuts(order.size(), 0);
  PlanTiming t = timing;
  std::vector<char> cuts;
  for (int widen = 64; widen >= 1; widen /= 2) {
    t.gap_us = timing.gap_us * widen;
    auto plan = plan_buckets(order, params, first_cap_bytes, cap_bytes, late, {}, &t, &cuts);
    const double cost = predicted_cost_us(plan, timing);
    if (cost < best_cost) {
      best = std::move(plan);
      best_cost = cost;
      best_cuts = cuts;
    }
  }
  // The dynamic programme's plan, if strictly cheaper still.
  if (auto cuts_dp = cheapest_cuts(order, params, first_cap_bytes, cap_bytes, late, timing);
      !cuts_dp.empty()) {
    auto plan = plan_buckets(order, params, first_cap_bytes, cap_bytes, late, cuts_dp);
    if (predicted_cost_us(plan, timing) < best_cost) {
      best = std::move(plan);
      best_cuts = std::move(cuts_dp);
    }
  }
  if (timing_cuts) *timing_cuts = std::move(best_cuts);
  return best;
}

double launch_delay(const std::vector<BucketPlan>& plan, const std::vector<int>& arrival,
                    int num_params) {
  if (plan.empty() || num_params == 0) return 0.0;
  std::vector<int> pos(num_params, static_cast<int>(arrival.size()));
  for (size_t k = 0; k < arrival.size(); ++k) pos[arrival[k]] = static_cast<int>(k);
  double total = 0;
  int launch = -1;
  for (const auto& b : plan) {
    int ready = b.late ? static_cast<int>(arrival.size()) : -1;
    for (int p : b.params) ready = std::max(ready, pos[p]);
    launch = std::max(launch, ready);
    total += launch - ready;
  }
  return total / plan.size() / std::max<size_t>(1, arrival.size());
}

bool reorder_pays(const std::vector<BucketPlan>& current, const std::vector<BucketPlan>& candidate,
                  const std::vector<int>& arrival, int num_params) {
  auto order = [](const std::vector<BucketPlan>& plan) {
    std::vector<int> o;
    for (const auto& b : plan) o.insert(o.end(), b.params.begin(), b.params.end());
    return o;
  };
  return order(current) != order(candidate) &&
         launch_delay(current, arrival, num_params) >
             launch_delay(candidate, arrival, num_params) + 0.02;
}

}  // namespace ddpx::hooks
