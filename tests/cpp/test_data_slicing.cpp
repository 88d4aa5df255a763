// ddpx/data.h: its example, as it stands in the header, at 1, 2 and 3 ranks
// (simulated: each rank's slice computed here): the ranks' slices of global
// step k together are the permutation's elements [k B, (k + 1) B), in a
// round-robin deal, whatever the world size -- the data side of resuming at
// another world size (issue 46). And clear errors naming the argument.
#include <ATen/ATen.h>
#include <ddpx/data.h>
#include <gtest/gtest.h>

#include <string>

#include "mpi_test_util.h"  // error_of

namespace {

using ddpx::test::error_of;

// The header's example for (rank, world): this rank's slice.
at::Tensor run_example(int64_t n, int64_t B, uint64_t seed, int64_t epoch, int64_t step, int rank,
                       int world) {
#include "examples/data_slicing.inc"
  EXPECT_EQ(steps_per_epoch, n / B);
  return mine;
}

}  // namespace

TEST(DataSlicing, GlobalBatchesDoNotDependOnTheWorldSize) {
  constexpr int64_t n = 1003, B = 12;
  for (int64_t epoch : {0, 3}) {
    const at::Tensor perm = ddpx::data::epoch_permutation(n, epoch, 17);
    EXPECT_TRUE(at::equal(std::get<0>(perm.sort()), at::arange(n, at::kLong)));  // a permutation
    for (int64_t step : {int64_t{0}, int64_t{1}, n / B - 1}) {
      const at::Tensor want = perm.narrow(0, step * B, B);
      for (int world : {1, 2, 3}) {
        std::vector<at::Tensor> slices;
        for (int rank = 0; rank < world; ++rank) {
          slices.push_back(run_example(n, B, 17, epoch, step, rank, world));
          ASSERT_EQ(slices.back().numel(), B / world);
        }
        // Dealt round-robin: element j of rank r is want[j * world + r].
        const at::Tensor dealt = at::stack(slices, 1).reshape(-1);
        EXPECT_TRUE(at::equal(dealt, want))
            << "epoch " << epoch << " step " << step << " world " << world;
      }
    }
  }
  // Another epoch or seed: another order.
  EXPECT_FALSE(
      at::equal(ddpx::data::epoch_permutation(n, 0, 17), ddpx::data::epoch_permutation(n, 1, 17)));
  EXPECT_FALSE(
      at::equal(ddpx::data::epoch_permutation(n, 0, 17), ddpx::data::epoch_permutation(n, 0, 18)));
}

TEST(DataSlicing, BadArgumentsAreNamed) {
  const at::Tensor perm = ddpx::data::epoch_permutation(50, 0, 1);
  using ddpx::data::global_batch_slice;
  EXPECT_NE(error_of([&] {
              global_batch_slice(perm, 0, 10, 0, 3);
            }).find("global_batch 10 must be a positive multiple of world 3"),
            std::string::npos);
  EXPECT_NE(error_of([&] { global_batch_slice(perm, 0, 12, 3, 3); }).find("rank 3 is not in"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              global_batch_slice(perm, 4, 12, 0, 3);
            }).find("step 4 of 12 samples is outside the permutation's 50 (4 whole steps)"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              global_batch_slice(perm.to(at::kInt), 0, 12, 0, 3);
            }).find("permutation must be 1-D int64"),
            std::string::npos);
  EXPECT_NE(error_of([] { ddpx::data::steps_per_epoch(50, 0); }).find("global_batch must be > 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { ddpx::data::epoch_permutation(-1, 0, 1); }).find("n must be >= 0"),
            std::string::npos);
  EXPECT_EQ(ddpx::data::epoch_permutation(0, 0, 1).numel(), 0);
}
