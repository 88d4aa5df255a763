// comm::detail::wait_named: a backend's failure comes back naming the
// collective it was waiting for, once; input errors pass unchanged. (The
// whole path under Gloo: test_gloo_frozen_rank and the cut-link trainer test.)
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <stdexcept>

#include "plugin/comm/work_wait.h"

namespace {

using ddpx::comm::detail::name_collective;
using ddpx::comm::detail::wait_named;

// A Work whose wait() throws what the test gives it, as a backend's would.
class FailingWork : public c10d::Work {
 public:
  FailingWork(c10d::OpType op, std::exception_ptr error) : Work(0, op), error_(std::move(error)) {}
  bool wait(std::chrono::milliseconds) override {
    std::rethrow_exception(error_);
  }

 private:
  std::exception_ptr error_;
};

template <class E>
std::exception_ptr make(const std::string& what) {
  return std::make_exception_ptr(E(what));
}

std::string message_of(c10d::OpType op, std::exception_ptr error) {
  try {
    wait_named(c10::make_intrusive<FailingWork>(op, error));
  } catch (const c10::DistBackendError& e) {
    return e.what_without_backtrace();
  }
  return "(no DistBackendError)";
}

TEST(WorkWait, NamesTheCollectiveOfATransportError) {
  // Gloo's transport throws a plain std::runtime_error that names the transfer only.
  const auto gloo = make<std::runtime_error>("Timed out waiting 8000ms for recv operation to complete");
  EXPECT_EQ(message_of(c10d::OpType::ALLREDUCE, gloo),
            "waiting for allreduce: Timed out waiting 8000ms for recv operation to complete");
  EXPECT_EQ(message_of(c10d::OpType::ALLGATHER, gloo).rfind("waiting for allgather: ", 0), 0u);
  EXPECT_EQ(message_of(c10d::OpType::BROADCAST, gloo).rfind("waiting for broadcast: ", 0), 0u);
  EXPECT_EQ(message_of(c10d::OpType::UNKNOWN, gloo).rfind("waiting for a collective: ", 0), 0u);
}

TEST(WorkWait, ADistErrorThatNamesItAlreadyIsNotNamedTwice) {
  const std::string mpi = "ddpx_mpi: rank 0 timed out after 8000 ms waiting for allreduce: rank 1 died";
  EXPECT_EQ(name_collective(c10d::OpType::ALLREDUCE, mpi), mpi);
  try {
    C10_THROW_ERROR(DistBackendError, mpi);
  } catch (...) {
    EXPECT_EQ(message_of(c10d::OpType::ALLREDUCE, std::current_exception()), mpi);
  }
}

TEST(WorkWait, InputErrorsPassUnchanged) {
  // A c10::Error that is no backend failure (bad input, named by its check) keeps its type and text.
  std::exception_ptr bad;
  try {
    TORCH_CHECK_VALUE(false, "allreduce: tensors must be dense");
  } catch (...) {
    bad = std::current_exception();
  }
  try {
    wait_named(c10::make_intrusive<FailingWork>(c10d::OpType::ALLREDUCE, bad));
    FAIL() << "no error";
  } catch (const c10::DistError&) {
    FAIL() << "an input error became a backend error";
  } catch (const c10::ValueError& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()), "allreduce: tensors must be dense");
  }
}

TEST(WorkWait, ASuccessfulWaitReturns) {
  struct Done : c10d::Work {
    Done() : Work(0, c10d::OpType::ALLREDUCE) {}
    bool wait(std::chrono::milliseconds) override { return true; }
  };
  EXPECT_NO_THROW(wait_named(c10::make_intrusive<Done>()));
}

}  // namespace
