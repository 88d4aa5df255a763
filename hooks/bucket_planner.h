#pragma once
// Groups parameters into gradient buckets along a predicted arrival order,
// and scores how much a plan delays launches under an observed order.
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace ddpx::hooks {

struct ParamInfo {
  int64_t numel;
  c10::ScalarType dtype;
  c10::Device device;
  // Its gradients are sparse (COO, e.g. Embedding(sparse=true)): it gets a
  // bucket of its own, reduced as rows (sparse_reduce.h), with no dense
  // storage; as the rows sent are unknown, it counts no bytes in plans.
  bool sparse = false;
  // Its drop unit (GradSyncOptions::drop_units; -1: none): a bucket never
  // holds two units, nor a unit and other parameters, so a unit declared
  // unused for a step skips whole buckets (no partial sends).
  int unit = -1;
};

struct BucketPlan {
  std::vector<int> params;  // in the order they are laid out in the bucket
  int64_t numel = 0;
  // Holds late parameters (OrderPredictor::late): launched only at the end
  // of backward, after the used-parameter agreement, without the slots of
  // parameters unused on every rank.
  bool late = false;
  c10::ScalarType dtype = c10::ScalarType::Float;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  // One sparse parameter (ParamInfo::sparse), numel 0: no dense storage.
  bool sparse = false;
  // Priority (Overlap::NextForward, priority_tail): held back during
  // backward and launched at its end with the other held buckets in reverse
  // plan order -- the first layers' first, as the next forward needs them.
  bool held = false;
  // Priority, for a bucket still on the link when backward ends (ahead of
  // the held ones; priority_split): > 0, only its elements [0, held_from)
  // launch as it fills, the rest after the held buckets -- they overtake
  // its remainder, as a late urgent gradient overtakes queued pieces of a
  // large one (P3, ByteScheduler), even when it is a single parameter.
  int64_t held_from = 0;
};

// Arrival-time planning: when gradients are predicted to arrive and what the
// link does with them. Size caps alone cannot see that a bucket holding a
// ready gradient may wait for the next one while the link idles -- a large
// layer's weight gradient waiting out the next layer's whole backward, or,
// with gradients arriving evenly, the first half of backward's gradients
// waiting for the second; DDP's buckets are sized by bytes only.
struct PlanTiming {
  std::vector<double> arrival_us;  // per parameter, us from the start of backward; <0: unknown
  double gap_us = 1000;            // link idle time worth an extra launch
  double bytes_per_us = 0;         // the link's rate; 0: unknown (never busy)
  double launch_us = 100;          // a reduction's fixed cost beside its bytes
  bool late_at_end = true;         // late buckets launch at the end of backward (Predict)
  // Per parameter, the bytes its slot is expected to put on the wire from a
  // late bucket, which sends only the slots some rank used (its size times
  // how often that was so lately); empty: every slot, always.
  std::vector<double> late_bytes;
};

// Walks `order`; a sparse parameter gets a bucket of its own (never late: its
// reduction tells every rank who used it), listed before the first other
// bucket whose last parameter comes after it, which stays open around it.
// A bucket holds one dtype, device and drop unit (ParamInfo::unit) and closes when it would exceed its cap (the first bucket's
// cap is `first_cap_bytes`, so communication starts early). late[p] (empty: none) marks late
// parameters: they never share a bucket with the others. cuts[k] (empty: none) closes every open
// bucket before order[k]. With `timing`, every open bucket also closes before order[k] when, by the
// time order[k] arrives, the link would have sat idle with gradients ready to send for more than
// timing->gap_us: since the later of the link being free (buckets sent as they close, at the link's
// rate) and the open bucket's first arrival. An unknown rate: since the open bucket's last arrival,
// i.e. a pause in backward. `timing_cuts` (optional) gets those cuts, so that `cuts` reproduces the
// plan without the timing (another rank's). Buckets are listed in launch order.
std::vector<BucketPlan> plan_buckets(const std::vector<int>& order,
                                     const std::vector<ParamInfo>& params,
                                     int64_t first_cap_bytes, int64_t cap_bytes,
                                     const std::vector<char>& late = {},
                                     const std::vector<char>& cuts = {},
                                     const PlanTiming* timing = nullptr,
                                     std::vector<char>* timing_cuts = nullptr);

// When the last reduction of `plan` is predicted to finish, in us from the
// start of backward, under `timing` (whose rate must be known): gradients
// arrive at timing.arrival_us (unknown times, and late buckets if
// late_at_end: at the last arrival), buckets launch in plan order, and the
// link is the one plan_buckets imagines. A model, to compare two plans under
// the same arrivals.
double predicted_finish_us(const std::vector<BucketPlan>& plan, const PlanTiming& timing);

// What `plan` is predicted to cost, in us: predicted_finish_us plus
// timing.launch_us per bucket. A bucket's fixed cost is paid twice: on the
// link (in the finish) and in the CPU that its launch and its collective's
// fixed work take from backward when the cores are busy with backward --
// measured on loopback (2 ranks, 2 cores): each extra bucket of many520
// slowed backward by 0.3-0.4 ms, against a 155 us round trip.
double predicted_cost_us(const std::vector<BucketPlan>& plan, const PlanTiming& timing);

// The cheapest plan (predicted_cost_us) of: plan_buckets with no timing
// cuts; under `timing` with timing.gap_us widened 64, 32, ..., 1 times; and
// with the cuts of a dynamic programme over a coarse grid of `order`, whose
// buckets may grow and then shrink toward the end of backward, as no single
// gap makes them. On a tie, the one listed first. The gap rule alone keeps
// the link busy whenever gradients wait for it; on a link with time to spare
// that is a launch per gap of backward (40 buckets for many520 on loopback,
// 15% slower than 5), bought for a shorter tail that a few buckets nearly
// match. Unknown rate: plan_buckets as is (pauses only).
std::vector<BucketPlan> plan_buckets_cheapest(const std::vector<int>& order,
                                              const std::vector<ParamInfo>& params,
                                              int64_t first_cap_bytes, int64_t cap_bytes,
                                              const std::vector<char>& late,
                                              const PlanTiming& timing,
                                              std::vector<char>* timing_cuts = nullptr);

// Which buckets to hold for a priority launch (BucketPlan::held): the
// longest run of reliable dense buckets ending at the last of them (late
// buckets go after the agreement anyway) that, launched in plan order as
// they fill, would start on the link only at the end of backward or later --
// because their gradients come last or the link is still busy with earlier
// buckets. Launched together at the end in reverse order, they finish no
// later as a whole (the link stays busy from the end of backward on), but
// the first layers' updates land first, and the next forward, gated per
// parameter, starts while the rest is on the wire (P3's and ByteScheduler's
// priority, for the part of the step where it pays). Per bucket, 1: held;
// all 0 when the rate or the times are unknown or fewer than `min_run`
// qualify (one bucket alone is worth holding only to be cut into pieces, or
// to overtake a bucket cut by priority_split).
std::vector<char> priority_tail(const std::vector<BucketPlan>& plan, const PlanTiming& timing,
                                int min_run = 2);

// Cuts (as plan_buckets takes them, over `order`) that split the held
// buckets (`held`, from priority_tail) into up to `pieces` buckets of about
// equal bytes, at parameter boundaries: a held bucket of many layers would
// otherwise make the first layer wait for all of them (P3's slicing, at the
// planner's granularity). Merged with the plan's own cuts, plan_buckets
// reproduces the plan with the held part in pieces.
std::vector<char> priority_cuts(const std::vector<BucketPlan>& plan, const std::vector<char>& held,
                                const std::vector<int>& order, const std::vector<ParamInfo>& params,
                                int pieces);

// Where priority cuts a bucket in two (BucketPlan::held_from): the last
// dense, reliable, not held bucket that the link, launched in plan order as
// buckets fill, would still be sending when backward ends while held
// buckets (`held`, from priority_tail) wait behind it. Its remainder -- the
// bytes predicted to be left at the end of backward, rounded up to whole
// `piece` elements -- is held and sent after them. {-1, 0}: none (no held
// bucket, an unknown rate, or nothing left at the end).
struct PrioritySplit {
  int bucket = -1;
  int64_t from = 0;
};
PrioritySplit priority_split(const std::vector<BucketPlan>& plan, const std::vector<char>& held,
                             const PlanTiming& timing, int64_t piece);

// Launch delay of `plan` when gradients arrive in `arrival` (missing = arrive
// last): bucket b is ready when its last gradient arrives (a late bucket: at
// the end) and launches once all buckets before it launched; the score is the
// mean of (launch - ready) over buckets, as a fraction of the step's
// arrivals. 0 = no bucket waits.
double launch_delay(const std::vector<BucketPlan>& plan, const std::vector<int>& arrival,
                    int num_params);

// Does `candidate` lay the parameters out in another order than `current`
// and, under `arrival`, launch materially earlier (launch_delay lower by over
// 0.02)? The same order cut elsewhere never counts: that is the timing
// rule's to judge, with its hysteresis (a one-step wobble of the arrival
// times moved the cheapest cuts, and this rule re-planned for nothing).
bool reorder_pays(const std::vector<BucketPlan>& current, const std::vector<BucketPlan>& candidate,
                  const std::vector<int>& arrival, int num_params);

}  // namespace ddpx::hooks
