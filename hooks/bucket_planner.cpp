#include "hooks/bucket_planner.h"

#include <algorithm>
#include <map>
#include <tuple>

namespace ddpx::hooks {

std::vector<BucketPlan> plan_buckets(const std::vector<int>& order,
                                     const std::vector<ParamInfo>& params,
                                     int64_t first_cap_bytes, int64_t cap_bytes,
                                     const std::vector<char>& late,
                                     const std::vector<char>& cuts) {
  std::vector<BucketPlan> out;
  bool late_section = false;
  // One open bucket per (dtype, device); index into `out`. Integer keys: this
  // runs every step (GradSync's re-plan check), so no strings.
  std::map<std::tuple<int, int, int>, size_t> open;
  for (size_t k = 0; k < order.size(); ++k) {
    const int p = order[k];
    if (!cuts.empty() && cuts[k]) open.clear();
    const auto& info = params[p];
    const auto key = std::make_tuple(static_cast<int>(info.dtype), static_cast<int>(info.device.type()),
                                     static_cast<int>(info.device.index()));
    const int64_t bytes = info.numel * static_cast<int64_t>(c10::elementSize(info.dtype));
    const bool is_late = !late.empty() && late[p];
    if (is_late != late_section) {  // a late parameter never shares a bucket with a reliable one
      open.clear();
      late_section = is_late;
    }
    auto it = open.find(key);
    if (it != open.end()) {
      auto& b = out[it->second];
      const int64_t cap = it->second == 0 ? first_cap_bytes : cap_bytes;
      const int64_t have = b.numel * static_cast<int64_t>(c10::elementSize(b.dtype));
      if (have + bytes > cap) {
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
      it = open.emplace(key, out.size() - 1).first;
    }
    auto& b = out[it->second];
    b.params.push_back(p);
    b.numel += info.numel;
  }
  return out;
}

std::vector<char> gap_cuts(const std::vector<int>& order, const std::vector<double>& arrival_us,
                           double gap_us) {
  std::vector<char> cuts(order.size(), 0);
  double last = -1;  // the latest arrival so far (arrivals need not be monotone)
  for (size_t k = 0; k < order.size(); ++k) {
    const double t = arrival_us.empty() ? -1 : arrival_us[order[k]];
    if (t < 0) continue;
    if (last >= 0 && t - last > gap_us) cuts[k] = 1;
    last = std::max(last, t);
  }
  return cuts;
}

double predicted_finish_us(const std::vector<BucketPlan>& plan,
                           const std::vector<double>& arrival_us, double bytes_per_us,
                           double launch_us) {
  double end_of_backward = 0;
  for (double t : arrival_us) end_of_backward = std::max(end_of_backward, t);
  double launch = 0, link_free = 0;
  for (const auto& b : plan) {
    double ready = b.late ? end_of_backward : 0;
    for (int p : b.params) ready = std::max(ready, arrival_us[p] < 0 ? end_of_backward : arrival_us[p]);
    launch = std::max(launch, ready);  // launches keep plan order
    const double bytes = static_cast<double>(b.numel) * static_cast<double>(c10::elementSize(b.dtype));
    link_free = std::max(link_free, launch) + launch_us + bytes / bytes_per_us;
  }
  return link_free;
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

}  // namespace ddpx::hooks
