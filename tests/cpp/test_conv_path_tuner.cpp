// kernels/common/conv_path_tuner.h: the fastest candidate wins and is kept
// per key, the measuring call returns the winner's own result, a candidate
// clearly slower than the best so far is not run again and again, a stall in
// one round of measuring does not decide, and the switches that turn
// measuring on. Candidates here sleep for set times, far apart, so the order
// cannot flip with a busy machine's noise; the real paths are measured in
// tests/python/test_tiled_conv2d_paths.py (and test_tiled_conv2d_cuda.py).
// And the CUDA rule (kernels/common/tiled_conv2d_cuda_path.h) asked of shapes
// made on the CPU (ConvCudaRule).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "kernels/common/conv_path_tuner.h"
#include "kernels/common/tiled_conv2d_cuda_path.h"

namespace ddpx::detail {
namespace {

const c10::Device kCpu(c10::kCPU);

ConvTuneKey key(int64_t id) { return ConvTuneKey{{-1, id}}; }  // (no real problem has -1 first)

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

TEST(ConvPathTuner, FastestWinsAndItsResultIsReturned) {
  conv_path_tuning_clear();
  std::vector<int> runs(3, 0);
  const std::vector<int> cost_ms{8, 0, 20};
  const std::string got = conv_tune<std::string>(key(1), kCpu, 3, [&](int i) {
    ++runs[i];
    sleep_ms(cost_ms[i]);
    return "result of " + std::to_string(i);
  });
  EXPECT_EQ(got, "result of 1");
  EXPECT_EQ(conv_tuned_choice(key(1)), 1);
  // Round one, candidate 0 (first, nothing to beat): warm-up, one timed
  // call, then about a millisecond's worth (one call). The 0 ms candidate:
  // up to 20 back-to-back calls. Candidate 2, far over 4x the best: warm-up
  // and one. The later rounds: no warm-up, and one call of each slow one.
  static_assert(kConvTuneRounds == 3);
  EXPECT_EQ(runs[0], 3 + 2);
  EXPECT_GE(runs[1], 3 + 2 * 2);
  EXPECT_LE(runs[1], 22 + 2 * 21);
  EXPECT_EQ(runs[2], 2 + 2);
}

TEST(ConvPathTuner, AStallInOneRoundDoesNotDecide) {
  // Candidate 0 costs nothing, but its timed calls of round one stall for
  // 30 ms (the machine busy with something else just then); candidate 1
  // always costs 5 ms. Measured once, candidate 1 would win six times over.
  conv_path_tuning_clear();
  int calls0 = 0;
  const int got = conv_tune<int>(key(8), kCpu, 2, [&](int i) {
    if (i == 0) {
      if (++calls0 == 2 || calls0 == 3) sleep_ms(30);  // (call 1 is round one's warm-up)
    } else {
      sleep_ms(5);
    }
    return i;
  });
  EXPECT_EQ(got, 0);
  EXPECT_EQ(conv_tuned_choice(key(8)), 0);
}

TEST(ConvPathTuner, ChoicesAreKeptPerKeyUntilCleared) {
  conv_path_tuning_clear();
  const auto tune = [](int64_t id, int fast) {
    return conv_tune<int>(key(id), kCpu, 2, [&](int i) {
      sleep_ms(i == fast ? 0 : 10);
      return i;
    });
  };
  EXPECT_EQ(tune(2, 0), 0);
  EXPECT_EQ(tune(3, 1), 1);
  EXPECT_EQ(conv_tuned_choice(key(2)), 0);
  EXPECT_EQ(conv_tuned_choice(key(3)), 1);
  EXPECT_FALSE(conv_tuned_choice(key(4)).has_value());
  conv_path_tuning_clear();
  EXPECT_FALSE(conv_tuned_choice(key(2)).has_value());
}

TEST(ConvPathTuner, AFirstCallsOneTimeCostDoesNotDecide) {
  // Candidate 0 pays 40 ms on its first call only (as oneDNN's primitive or
  // cuDNN's algorithm search does), then costs nothing; candidate 1 always
  // costs 5 ms. The warm-up absorbs the one-time cost.
  conv_path_tuning_clear();
  bool first = true;
  const int got = conv_tune<int>(key(5), kCpu, 2, [&](int i) {
    if (i == 0) {
      if (first) sleep_ms(40);
      first = false;
    } else {
      sleep_ms(5);
    }
    return i;
  });
  EXPECT_EQ(got, 0);
}

TEST(ConvPathTuner, AFailingCandidateIsLeftOut) {
  conv_path_tuning_clear();
  // The fastest fails (as cuDNN does for a problem it has no algorithm for):
  // the next fastest serves and is kept.
  const int got = conv_tune<int>(key(6), kCpu, 3, [&](int i) {
    TORCH_CHECK(i != 1, "candidate 1 cannot do this problem");
    sleep_ms(i == 0 ? 10 : 0);
    return i;
  });
  EXPECT_EQ(got, 2);
  EXPECT_EQ(conv_tuned_choice(key(6)), 2);
  // All fail: the first one's error, nothing kept.
  EXPECT_THROW(
      {
        try {
          conv_tune<int>(key(7), kCpu, 2,
                         [&](int i) -> int { TORCH_CHECK(false, "candidate ", i, " failed"); });
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("candidate 0 failed"), std::string::npos);
          throw;
        }
      },
      c10::Error);
  EXPECT_FALSE(conv_tuned_choice(key(7)).has_value());
}

TEST(ConvPathTuner, TheSwitches) {
  const char* was = std::getenv("DDPX_CONV_PATH");
  const bool cudnn_was = at::globalContext().benchmarkCuDNN();
  setenv("DDPX_CONV_PATH", "benchmark", 1);
  EXPECT_TRUE(conv_benchmark_mode(c10::DeviceType::CPU));
  EXPECT_TRUE(conv_benchmark_mode(c10::DeviceType::CUDA));
  setenv("DDPX_CONV_PATH", "auto", 1);
  at::globalContext().setBenchmarkCuDNN(false);
  EXPECT_FALSE(conv_benchmark_mode(c10::DeviceType::CPU));
  EXPECT_FALSE(conv_benchmark_mode(c10::DeviceType::CUDA));
  // torch.backends.cudnn.benchmark: measure on CUDA (not the CPU's paths).
  at::globalContext().setBenchmarkCuDNN(true);
  EXPECT_FALSE(conv_benchmark_mode(c10::DeviceType::CPU));
  EXPECT_TRUE(conv_benchmark_mode(c10::DeviceType::CUDA));
  // A forced path wins over the flag.
  setenv("DDPX_CONV_PATH", "aten", 1);
  EXPECT_FALSE(conv_benchmark_mode(c10::DeviceType::CUDA));
  at::globalContext().setBenchmarkCuDNN(cudnn_was);
  if (was != nullptr) {
    setenv("DDPX_CONV_PATH", was, 1);
  } else {
    unsetenv("DDPX_CONV_PATH");
  }
}

// What the H200 measured (2026-11-30), case by case as the header's table.
TEST(ConvCudaRule, OursWhereTheH200MeasuredItFaster) {
  struct Case {
    std::vector<int64_t> x, w;
    int64_t stride = 1, groups = 1, dilation = 1;
    bool channels_last = false;
    at::ScalarType dtype = at::kFloat;
  };
  const auto aten = [](const Case& c, cuda::Pass pass) {
    // (the shape made of float32 CPU tensors: the CPU has no float16 conv)
    const auto o = at::TensorOptions().memory_format(
        c.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
    const int64_t pad = c.w[2] / 2 * c.dilation;
    const Conv2dShape s = check_tiled_conv2d_args(at::empty(c.x, o), at::empty(c.w, o),
                                                  std::nullopt, {c.stride, c.stride}, {pad, pad},
                                                  {c.dilation, c.dilation}, c.groups);
    return cuda::rule_aten(s, c.dtype, pass);
  };
  const auto fwd = cuda::Pass::kForward, bwd = cuda::Pass::kBackward;
  const Case seed3{{1, 1, 512, 512}, {1, 1, 3, 3}}, seed5{{1, 1, 64, 64}, {2, 1, 5, 5}};
  const Case lenet1{{64, 1, 28, 28}, {6, 1, 5, 5}}, lenet2{{64, 6, 14, 14}, {16, 6, 5, 5}};
  for (const Case& c : {seed3, seed5}) {
    EXPECT_FALSE(aten(c, fwd));
    EXPECT_FALSE(aten(c, bwd));
  }
  EXPECT_FALSE(aten(lenet1, fwd));
  EXPECT_TRUE(aten(lenet1, bwd));
  EXPECT_TRUE(aten(lenet2, fwd));
  EXPECT_TRUE(aten({{8, 64, 56, 56}, {64, 64, 3, 3}}, fwd));  // resnet
  const auto dw = [](int64_t k, int64_t stride, bool cl) {
    return Case{{8, 32, 56, 56}, {32, 1, k, k}, stride, 32, 1, cl};
  };
  for (const bool cl : {false, true}) {
    EXPECT_TRUE(aten(dw(3, 1, cl), fwd));
    EXPECT_TRUE(aten(dw(3, 1, cl), bwd));
    EXPECT_FALSE(aten(dw(5, 1, cl), fwd));
    EXPECT_FALSE(aten(dw(5, 2, cl), bwd));
    EXPECT_FALSE(aten(dw(7, 1, cl), fwd));
    EXPECT_FALSE(aten(dw(7, 1, cl), bwd));
  }
  EXPECT_FALSE(aten(dw(3, 2, false), fwd));
  EXPECT_FALSE(aten(dw(3, 2, false), bwd));
  EXPECT_TRUE(aten(dw(3, 2, true), fwd));
  // NCHW planes under half our tile: ATen's kernel (channels_last: ours, a
  // thread per channel).
  for (const int64_t hw : {14, 7}) {
    for (const bool cl : {false, true}) {
      Case small = dw(7, 1, cl);
      small.x[2] = small.x[3] = hw;
      EXPECT_EQ(aten(small, fwd), !cl) << hw;
      EXPECT_EQ(aten(small, bwd), !cl) << hw;
    }
  }
  Case tall = dw(5, 1, false);  // (a 24x24 plane fills 56% of one tile)
  tall.x[2] = tall.x[3] = 24;
  EXPECT_FALSE(aten(tall, fwd));
  tall.x[2] = tall.x[3] = 40;  // (two tiles each way, 39% filled)
  EXPECT_TRUE(aten(tall, fwd));
  Case down = dw(3, 2, false);  // (stride 2: the output plane counts, 14x14)
  down.x[2] = down.x[3] = 28;
  EXPECT_TRUE(aten(down, fwd));
  // Outside what was measured: cuDNN.
  Case c = dw(7, 1, false);
  c.dtype = at::kHalf;
  EXPECT_TRUE(aten(c, fwd));
  c = dw(7, 1, false);
  c.dilation = 2;
  EXPECT_TRUE(aten(c, fwd));
  // (no small-filter kernel for these: ours would be the general kernels)
  EXPECT_TRUE(aten(dw(7, 3, false), fwd));
  EXPECT_TRUE(aten(dw(6, 1, false), fwd));
  EXPECT_TRUE(aten(dw(9, 1, false), fwd));
  EXPECT_TRUE(aten({{1, 1, 64, 64}, {1, 1, 1, 1}}, fwd));
  EXPECT_TRUE(aten({{1, 1, 64, 64}, {1, 1, 4, 4}}, bwd));
  EXPECT_TRUE(aten({{1, 1, 64, 64}, {1, 1, 3, 3}, 1, 1, 2}, fwd));  // dilated
  EXPECT_TRUE(aten({{1, 1, 64, 64}, {16, 1, 3, 3}}, fwd));  // (up to 8 filters measured)
  EXPECT_TRUE(aten({{8, 32, 28, 28}, {64, 1, 5, 5}, 1, 32}, fwd));  // (two filters per channel)
}

}  // namespace
}  // namespace ddpx::detail
