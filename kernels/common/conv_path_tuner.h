#pragma once
// Measured path choice for ddpx::tiled_conv2d, as torch.backends.cudnn.benchmark
// is for cuDNN's algorithms: the first call of one pass (forward or backward)
// of one problem runs every candidate path on the caller's own tensors, keeps
// the fastest, and every later call of that pass and problem takes it.
//
// Why: the fixed rules (kernels/cpu/tiled_conv2d_path.h,
// kernels/common/tiled_conv2d_cuda_path.h) were drawn from one machine of
// each kind; a shape, a card or a thread count they were not drawn from can
// be slower than F.conv2d with them. Measuring on the machine that trains
// cannot lose by more than the measurement's noise.
//
// On when DDPX_CONV_PATH=benchmark (CPU and CUDA), or on CUDA when
// DDPX_CONV_PATH is unset or `auto` and torch.backends.cudnn.benchmark is
// set (the user's "measure the algorithms for my shapes", which then covers
// the choice between cuDNN and our kernels too). The cost is the first call
// per problem (each candidate runs a few times in each of kConvTuneRounds
// rounds, with device syncs); the paths round differently, so, as with
// cuDNN's benchmark mode, which one a run takes, and its last bits, can
// differ between runs and machines.
//
// A choice is kept per device, dtype, geometry, pass and (on the CPU) thread
// count, for the life of the process (conv_path_tuning_clear forgets them).
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common/tiled_conv2d_args.h"

namespace ddpx::detail {

// Whether calls on a device of this type choose their path by measurement,
// given DDPX_CONV_PATH's value `want` (conv_path_override(), which a caller
// has often read already: a getenv per read, on every call of the op), or
// reading it.
bool conv_benchmark_mode(c10::DeviceType type, const std::string& want);
bool conv_benchmark_mode(c10::DeviceType type);

// What identifies one measured choice.
struct ConvTuneKey {
  std::vector<int64_t> fields;
  bool operator==(const ConvTuneKey& o) const { return fields == o.fields; }
};

// `pass`: 0 forward, 1 backward (the callers' own enums differ per device).
ConvTuneKey conv_tune_key(const Conv2dShape& s, c10::Device device, at::ScalarType dtype,
                          int pass);

// The measured winner for `key` (an index into the caller's candidates), if
// it has been measured.
std::optional<int> conv_tuned_choice(const ConvTuneKey& key);

// Forgets every measured choice (the next call of each problem measures
// again).
void conv_path_tuning_clear();

// Seconds per call of `fn` on `device`, device work included: one warm-up
// call when `warm_up` (a first call pays one-time costs: oneDNN's primitive,
// cuDNN's own algorithm search), one timed call, then, unless that one is
// already more than 4x `beat` (the best so far), as many back-to-back calls
// as fit in about a millisecond (1 to 20), whose mean is the figure if
// lower. The device's current stream is synchronized around each timing.
double conv_time_candidate(c10::Device device, double beat, const std::function<void()>& fn,
                           bool warm_up = true);

// Records the winner of `key`.
void conv_remember_choice(const ConvTuneKey& key, int choice);

// How many times conv_tune measures each candidate. One round can mislead: a
// busy machine (another process on the core, an OpenMP barrier waiting for a
// descheduled thread) slows whichever candidate is running then, by 5x and
// more on a loaded 2-core CI runner, enough to make a path 5-28x slower win.
// Rounds interleave the candidates and each keeps its best figure, so a
// stall decides only if it hits every round of the faster candidates.
inline constexpr int kConvTuneRounds = 3;

// Measures candidates 0..count-1 with `run(i)` on `device` (kConvTuneRounds
// rounds, each candidate once per round, its best figure counting), remembers
// the fastest for `key`, and returns its result (from a timed call of it, so
// the measured call still does the caller's work). A candidate that throws a
// c10::Error (cuDNN without an algorithm for the problem, out of memory for
// its workspace) is left out, as cuDNN's own benchmark mode leaves out an
// algorithm that fails; when every one does, the first one's error is
// thrown and nothing is remembered.
template <class R>
R conv_tune(const ConvTuneKey& key, c10::Device device, int count,
            const std::function<R(int)>& run) {
  constexpr double kNone = std::numeric_limits<double>::infinity();
  std::vector<double> best_of(count, kNone);  // (kNone: failed, or not run yet)
  std::vector<bool> failed(count, false);
  R best_result{};  // (only the leader's: a conv's outputs can be large)
  bool have_result = false;
  int best = -1;
  std::exception_ptr first_error;
  for (int round = 0; round < kConvTuneRounds; ++round) {
    for (int c = 0; c < count; ++c) {
      if (failed[c]) continue;
      R result;
      double s = 0;
      try {
        s = conv_time_candidate(
            device, best < 0 ? kNone : best_of[best], [&] { result = run(c); }, round == 0);
      } catch (const c10::Error&) {
        if (!first_error) first_error = std::current_exception();
        failed[c] = true;
        best_of[c] = kNone;
        if (best == c) {  // (it failed after it led: the next best leads, result to come)
          best_result = R{};
          have_result = false;
          best =
              static_cast<int>(std::min_element(best_of.begin(), best_of.end()) - best_of.begin());
          if (best_of[best] == kNone) best = -1;
        }
        continue;
      }
      best_of[c] = std::min(best_of[c], s);
      if (best < 0 || c == best || best_of[c] < best_of[best]) {
        best = c;
        best_result = std::move(result);
        have_result = true;
      }
    }
  }
  if (best < 0) std::rethrow_exception(first_error);
  conv_remember_choice(key, best);
  return have_result ? std::move(best_result) : run(best);
}

}  // namespace ddpx::detail
