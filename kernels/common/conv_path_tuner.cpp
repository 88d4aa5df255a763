#include "kernels/common/conv_path_tuner.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/hash.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <unordered_map>

namespace ddpx::detail {
namespace {

struct KeyHash {
  size_t operator()(const ConvTuneKey& k) const { return c10::get_hash(k.fields); }
};

struct Choices {
  std::mutex mu;
  std::unordered_map<ConvTuneKey, int, KeyHash> map;
};

Choices& choices() {
  static Choices* c = new Choices();  // (never destroyed: kernels may run during exit)
  return *c;
}

void wait_for(c10::Device device) {
  if (device.is_cpu()) return;
  c10::impl::VirtualGuardImpl(device.type()).getStream(device).synchronize();
}

}  // namespace

bool conv_benchmark_mode(c10::DeviceType type, const std::string& want) {
  if (want == "benchmark") return true;
  return want == "auto" && type == c10::DeviceType::CUDA && at::globalContext().benchmarkCuDNN();
}

bool conv_benchmark_mode(c10::DeviceType type) {
  return conv_benchmark_mode(type, conv_path_override());
}

ConvTuneKey conv_tune_key(const Conv2dShape& s, c10::Device device, at::ScalarType dtype,
                          int pass) {
  // The CPU paths' speeds depend on the intra-op thread count (ours and
  // oneDNN's scale differently); a device's kernels do not.
  const int64_t threads = device.is_cpu() ? at::get_num_threads() : 0;
  // A device's peer is cuDNN, whose choice of algorithm (and so its speed)
  // follows these settings: a measurement made under others is not reused.
  const auto& ctx = at::globalContext();
  const int64_t cudnn = device.is_cpu() ? 0
                                        : ctx.allowTF32CuDNN(at::Float32Op::CONV) +
                                              2 * ctx.deterministicCuDNN() +
                                              4 * ctx.userEnabledCuDNN();
  return ConvTuneKey{{static_cast<int64_t>(device.type()), device.index(),
                      static_cast<int64_t>(dtype), pass, threads, cudnn, s.n.expect_int(),
                      s.c_in.expect_int(), s.h.expect_int(), s.w.expect_int(),
                      s.c_out.expect_int(), s.kh.expect_int(), s.kw.expect_int(), s.stride[0],
                      s.stride[1], s.padding[0], s.padding[1], s.dilation[0], s.dilation[1],
                      s.groups, static_cast<int64_t>(s.layout)}};
}

std::optional<int> conv_tuned_choice(const ConvTuneKey& key) {
  Choices& c = choices();
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.map.find(key);
  if (it == c.map.end()) return std::nullopt;
  return it->second;
}

void conv_remember_choice(const ConvTuneKey& key, int choice) {
  Choices& c = choices();
  std::lock_guard<std::mutex> lock(c.mu);
  c.map[key] = choice;  // (two threads measuring one problem at once: the later stands)
}

void conv_path_tuning_clear() {
  Choices& c = choices();
  std::lock_guard<std::mutex> lock(c.mu);
  c.map.clear();
}

double conv_time_candidate(c10::Device device, double beat, const std::function<void()>& fn,
                           bool warm_up) {
  using clock = std::chrono::steady_clock;
  const auto timed = [&](int calls) {
    wait_for(device);
    const auto t0 = clock::now();
    for (int i = 0; i < calls; ++i) fn();
    wait_for(device);
    return std::chrono::duration<double>(clock::now() - t0).count() / calls;
  };
  if (warm_up) timed(1);
  const double one = timed(1);
  if (one > 4 * beat) return one;
  // About a millisecond of calls: a single short call's time is mostly the
  // syncs' and the clock's, which back-to-back calls spread out.
  const int calls = static_cast<int>(std::clamp(1e-3 / std::max(one, 1e-9), 1.0, 20.0));
  return std::min(one, timed(calls));
}

}  // namespace ddpx::detail
