#pragma once
// Shared by the multi-rank GoogleTest suites: one world backend per process,
// the rank-dependent values whose reductions are exact in every dtype, and
// the text of an expected error.
#include <ATen/ATen.h>
#include <ddpx/comm.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

// In a test body: skips without a visible GPU, or fails under
// DDPX_REQUIRE_GPU=1 (scripts/device/check.sh: there nothing may pass by
// skipping).
#define DDPX_SKIP_WITHOUT_GPU()                                                         \
  do {                                                                                  \
    if (!torch::cuda::is_available()) {                                                 \
      const char* require = std::getenv("DDPX_REQUIRE_GPU");                            \
      if (require != nullptr && std::string(require) == "1") {                          \
        FAIL() << "no CUDA device visible (DDPX_REQUIRE_GPU=1)";                        \
      }                                                                                 \
      GTEST_SKIP() << "no CUDA device visible";                                         \
    }                                                                                   \
  } while (0)

namespace ddpx::test {

inline c10::intrusive_ptr<c10d::Backend>& world() {
  static auto be = ddpx::comm::make_mpi_backend();
  return be;
}

// The launcher's process group (ddpx_mpi under mpirun), one per process:
// what a trainer gets from init_from_env().
inline ddpx::comm::ProcessGroupPtr& world_pg() {
  static auto pg = ddpx::comm::init_from_env();
  return pg;
}

// Element i on rank r: 1 + (r + i) % 3 (bool: even or odd), so sums,
// products and extrema of up to 3 ranks fit even int8 and fp16 exactly.
inline at::Tensor rank_values(int rank, int64_t n, at::ScalarType dtype) {
  auto idx = at::arange(n, at::kLong);
  if (dtype == at::kBool) return ((idx + rank) % 2).eq(0);
  return (1 + (idx + rank) % 3).to(dtype);
}

// The message of the c10::Error that fn throws (without backtrace); "" if it
// throws none.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// Every rank's bytes, on every rank.
inline std::vector<std::string> all_bytes(c10d::ProcessGroup& pg, const std::string& mine) {
  std::vector<at::Tensor> size{at::full({pg.getSize()}, 0, at::kLong)};
  size[0][pg.getRank()] = static_cast<int64_t>(mine.size());
  pg.allreduce(size)->wait();
  const int64_t most = size[0].max().item<int64_t>();
  std::vector<at::Tensor> in{at::zeros({most}, at::kByte)};
  std::memcpy(in[0].data_ptr(), mine.data(), mine.size());
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < pg.getSize(); ++r) out[0].push_back(at::empty({most}, at::kByte));
  pg.allgather(out, in)->wait();
  std::vector<std::string> all;
  for (int r = 0; r < pg.getSize(); ++r) {
    all.emplace_back(static_cast<const char*>(out[0][r].data_ptr()), size[0][r].item<int64_t>());
  }
  return all;
}

}  // namespace ddpx::test
