#pragma once
// What one reduction costs on this job's link, learnt from GradSync's own
// collectives: busy_us = launch_us + bytes / bytes_per_us.
//
// launch_us is a small collective's round trip: the step-end agreement (a
// few ints, on channel 0 after the step's buckets) as timed by the rank that
// arrived last (GradSync carries each rank's time in the next agreement and
// takes the least), the least of the last 8 steps. A collective also waits
// for the slowest rank, and that skew is paid once per step, not per
// bucket: timed on rank 0 alone, the trip of ddpx_mpi's first steps came out
// at 21 ms against 0.6 ms later, and the plans made with it churned. (A line
// fitted through (bytes, busy time) of the buckets was tried first: the
// first bucket of a step carries the skew too, and the intercepts came out
// between 2 and 60 ms on one test.)
//
// bytes_per_us is the step's bytes over its busy time less one launch per
// bucket, averaged over steps with decaying weights (about the last five
// count), so a changed link is learnt again.
#include <deque>
#include <utility>
#include <vector>

namespace ddpx::hooks {

class LinkEstimate {
 public:
  static constexpr double kDefaultLaunchUs = 100;  // until a round trip is seen

  // One step's buckets: (bytes sent, us the link was busy with them).
  // Samples with no bytes or no time are ignored.
  void add_step(const std::vector<std::pair<double, double>>& samples);
  // A small collective's duration, start to end on its channel thread.
  void add_round_trip(double us);

  double bytes_per_us() const { return busy_ > 0 ? bytes_ / busy_ : 0; }  // 0: no step yet
  double launch_us() const;

 private:
  double bytes_ = 0, busy_ = 0;  // decayed sums over steps
  std::deque<double> trips_;  // the last 8 round trips
};

// One use of the link by a bucket: its reduction (from its launch) or, sharded,
// its gather (from its start), until it ended.
struct LinkSpan {
  double begin_us, end_us;
  size_t bucket;
};

// Per bucket, the time the link was busy with it (-1: no span): its spans
// in the order they ended (a channel runs its jobs in the order queued; a
// reduction's begin is when it was queued, which may be before a gather
// queued ahead of it began), each from when the link was free.
// A sharded bucket's reduction and gather both count (each half an
// all-reduce's bytes), so add_step learns an all-reduce's rate either way.
// (Its gather runs behind the next bucket's reduction; the reduction after
// that counts from the gather's end.)
std::vector<double> link_busy_us(std::vector<LinkSpan> spans, size_t buckets);

// Per parameter, the share of recent steps in which some rank used it: what
// its slot in a late bucket puts on the link on average (PlanTiming). A
// plain mean over the first 1/alpha steps, then an average that forgets
// (alpha per step). Started at 1.0 and averaged with alpha alone, it took ~8
// steps to learn that two alternating experts each send half the time, and
// the timing plans made meanwhile counted their late bucket too big.
class UseRate {
 public:
  explicit UseRate(int num_params, double alpha = 0.25) : alpha_(alpha), rate_(num_params, 1.0) {}
  void observe(const std::vector<char>& used_anywhere);
  double operator[](int param) const { return rate_[param]; }

 private:
  double alpha_;
  int steps_ = 0;
  std::vector<double> rate_;
};

}  // namespace ddpx::hooks
