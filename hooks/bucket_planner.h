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
};

// Walks `order`; a bucket holds one dtype and device and closes when it would
// exceed its cap (the first bucket's cap is `first_cap_bytes`, so
// communication starts early). late[p] (empty: none) marks late parameters:
// they never share a bucket with the others. cuts[k] (empty: none) closes
// every open bucket before order[k] (see gap_cuts). Buckets are listed in
// launch order.
std::vector<BucketPlan> plan_buckets(const std::vector<int>& order,
                                     const std::vector<ParamInfo>& params,
                                     int64_t first_cap_bytes, int64_t cap_bytes,
                                     const std::vector<char>& late = {},
                                     const std::vector<char>& cuts = {});

// Where a bucket should close early because of time, not size: cuts[k] = 1
// when order[k]'s gradient is predicted to arrive more than `gap_us` after
// the one before it (`arrival_us`: per parameter, from the start of
// backward; negative = unknown, taken as no gap). A bucket that would span
// such a gap holds gradients that are ready but cannot be sent until the
// gap ends -- e.g. a large layer's weight gradient waiting for the next
// layer's whole backward -- while the link idles. Size caps alone cannot see
// this; DDP's buckets are sized by bytes only.
std::vector<char> gap_cuts(const std::vector<int>& order, const std::vector<double>& arrival_us,
                           double gap_us);

// When the last reduction of `plan` is predicted to finish, in us from the
// start of backward, with gradients arriving at `arrival_us` (as above; late
// buckets and unknown times: at the last arrival), buckets launched in plan
// order, and one link that carries `bytes_per_us` and spends `launch_us` per
// reduction on top. A model, to compare two plans under the same arrivals.
double predicted_finish_us(const std::vector<BucketPlan>& plan,
                           const std::vector<double>& arrival_us, double bytes_per_us,
                           double launch_us);

// Launch delay of `plan` when gradients arrive in `arrival` (missing = arrive
// last): bucket b is ready when its last gradient arrives (a late bucket: at
// the end) and launches once all buckets before it launched; the score is the
// mean of (launch - ready) over buckets, as a fraction of the step's
// arrivals. 0 = no bucket waits.
double launch_delay(const std::vector<BucketPlan>& plan, const std::vector<int>& arrival,
                    int num_params);

}  // namespace ddpx::hooks
