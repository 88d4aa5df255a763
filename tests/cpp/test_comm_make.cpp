// ddpx::comm process-group construction under mpirun: init_from_env picks
// ddpx_mpi, make("gloo") bootstraps Gloo's store over MPI, sub-groups work,
// and collectives through c10d::ProcessGroup (the dispatcher path) agree.
#include <gtest/gtest.h>

#include "mpi_test_util.h"

namespace {

TEST(Comm, InitFromEnvUnderMpirunIsDdpxMpi) {
  ASSERT_EQ(ddpx::comm::detect_launcher(), ddpx::comm::Launcher::Mpi);
  auto pg = ddpx::comm::init_from_env();
  EXPECT_EQ(pg->getDefaultBackend()->getBackendName(), "ddpx_mpi");
  std::vector<at::Tensor> t{at::full({5}, float(pg->getRank() + 1))};
  pg->allreduce(t)->wait();
  const int n = pg->getSize();
  EXPECT_TRUE(at::equal(t[0], at::full({5}, n * (n + 1) / 2.0f)));
}

TEST(Comm, GlooOverMpiBootstrappedStore) {
  ddpx::comm::MakeOptions o;
  o.name = "gloo_test";
  auto pg = ddpx::comm::make("gloo", o);
  EXPECT_EQ(pg->getDefaultBackend()->getBackendName(), "gloo");
  std::vector<at::Tensor> t{at::full({1000}, float(pg->getRank()))};
  pg->allreduce(t)->wait();
  const int n = pg->getSize();
  EXPECT_TRUE(at::equal(t[0], at::full({1000}, n * (n - 1) / 2.0f)));
}

TEST(Comm, UnknownBackendNamesTheChoices) {
  try {
    ddpx::comm::make("carrier_pigeon");
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ddpx_mpi"), std::string::npos) << e.what();
  }
}

TEST(Comm, SubGroupOfEvenRanks) {
  auto& world = ddpx::test::world();
  const int r = world->getRank(), n = world->getSize();
  std::vector<int> evens;
  for (int i = 0; i < n; i += 2) evens.push_back(i);
  if (r % 2 == 0) {
    auto sub = ddpx::comm::make_mpi_backend(evens);
    EXPECT_EQ(sub->getSize(), static_cast<int>(evens.size()));
    EXPECT_EQ(sub->getRank(), r / 2);
    std::vector<at::Tensor> t{at::full({3}, float(r))};
    sub->allreduce(t)->wait();
    float want = 0;
    for (int e : evens) want += e;
    EXPECT_TRUE(at::equal(t[0], at::full({3}, want)));
  }
  // Both groups at once on the same process: the world still works.
  std::vector<at::Tensor> t{at::ones({2})};
  world->allreduce(t)->wait();
  EXPECT_TRUE(at::equal(t[0], at::full({2}, float(n))));
}


// roll_call: every rank checks in on the store, so with everyone there, it
// names no one silent; a rank that checks in from another `seq` is named as
// such. (The silent case runs end to end in test_gloo_frozen_rank.)
TEST(Comm, RollCallNamesRanksThatFailedElsewhere) {
  ddpx::comm::MakeOptions o;
  o.name = "roll_call_test";
  auto pg = ddpx::comm::make("gloo", o);
  const int rank = pg->getRank();
  const auto grace = std::chrono::milliseconds(3000);
  const std::string alike = ddpx::comm::roll_call(*pg, 5, grace);
  EXPECT_NE(alike.find("every rank answered"), std::string::npos) << alike;
  pg->barrier()->wait();
  const std::string split = ddpx::comm::roll_call(*pg, rank == 1 ? 7 : 5, grace);
  EXPECT_EQ(split.find("did not answer"), std::string::npos) << split;
  if (rank == 1) {  // every other rank is elsewhere from here
    const std::string others = pg->getSize() == 2 ? "rank 0 failed" : "ranks 0 and 2 failed";
    EXPECT_NE(split.find(others + " at a different point (7 here)"), std::string::npos) << split;
  } else {
    EXPECT_NE(split.find("rank 1 failed at a different point (5 here)"), std::string::npos)
        << split;
  }
}

// A group whose store no other process sees (ddpx_mpi's) has no one to ask.
TEST(Comm, RollCallOnAProcessLocalStoreSaysNothing) {
  auto pg = ddpx::comm::init_from_env();
  EXPECT_EQ(ddpx::comm::roll_call(*pg, 1, std::chrono::milliseconds(100)), "");
}

}  // namespace
