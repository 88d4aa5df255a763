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
// they never share a bucket with the others. Buckets are listed in launch
// order.
std::vector<BucketPlan> plan_buckets(const std::vector<int>& order,
                                     const std::vector<ParamInfo>& params,
                                     int64_t first_cap_bytes, int64_t cap_bytes,
                                     const std::vector<char>& late = {});

// Launch delay of `plan` when gradients arrive in `arrival` (missing = arrive
// last): bucket b is ready when its last gradient arrives (a late bucket: at
// the end) and launches once all buckets before it launched; the score is the
// mean of (launch - ready) over buckets, as a fraction of the step's
// arrivals. 0 = no bucket waits.
double launch_delay(const std::vector<BucketPlan>& plan, const std::vector<int>& arrival,
                    int num_params);

}  // namespace ddpx::hooks
