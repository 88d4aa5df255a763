#pragma once
// What the codec tests share (codec_test.cpp, codec_state_test.cpp,
// codec_scatter_test.cpp): the groups they run over and a suite over each,
// each rank's seeded input (every rank can rebuild every rank's, so
// references are computed locally in float64), and the message of a
// c10::Error (mpi_test_util.h's).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ddpx/comm.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>

#include "mpi_test_util.h"

namespace ddpx::test::codec {

inline ddpx::comm::ProcessGroupPtr group(const std::string& backend) {
  // Leaked: the groups must outlive every test and never be torn down after
  // MPI's exit handler has finalised MPI.
  static auto* groups = new std::map<std::string, ddpx::comm::ProcessGroupPtr>();
  auto& g = (*groups)[backend];
  if (!g) {
    ddpx::comm::MakeOptions o;
    o.name = "codec_test_" + backend;
    g = ddpx::comm::make(backend, o);
  }
  return g;
}

// Rank r's input for test case `seed`: normal * scale.
inline at::Tensor input_of(int rank, int64_t seed, at::IntArrayRef shape, double scale = 1.0) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed * 1000 + rank);
  return at::randn(shape, g, at::kFloat) * scale;
}

// A suite run over each backend its parameter names ("ddpx_mpi", "gloo").
class OverBackend : public ::testing::TestWithParam<std::string> {
 protected:
  c10d::ProcessGroup& pg() { return *group(GetParam()); }
  int rank() { return pg().getRank(); }
  int world() { return pg().getSize(); }
};

inline at::Tensor true_mean(int world, int64_t seed, at::IntArrayRef shape, double scale = 1.0) {
  auto s = at::zeros(shape, at::kDouble);
  for (int r = 0; r < world; ++r) s += input_of(r, seed, shape, scale).to(at::kDouble);
  return s / world;
}

using ddpx::test::error_of;

}  // namespace ddpx::test::codec
