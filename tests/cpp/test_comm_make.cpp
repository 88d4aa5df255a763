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

}  // namespace
