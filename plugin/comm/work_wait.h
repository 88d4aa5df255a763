#pragma once
// Waiting on a c10d Work so that a failure names the collective. ddpx_mpi's
// errors already do ("... waiting for allreduce: ..."); Gloo's name only the
// transfer ("Timed out waiting 8000ms for recv operation to complete"), and a
// user whose GradSync step failed on a cut link should not have to guess
// which collective it was. Used by GradSync and the codecs for every wait.
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace ddpx::comm::detail {

// work->wait(); a backend failure (c10::DistError or a plain std::exception,
// as Gloo's transport throws) comes back as a DistBackendError that starts
// "waiting for <collective>: " unless the message already says so. Other
// c10::Errors (bad input, named by whoever checked it) pass unchanged.
void wait_named(const c10::intrusive_ptr<c10d::Work>& work);

// The text of a backend's failure held in `error`: a c10::DistError's
// message without its backtrace, or a plain std::exception's. Any other
// c10::Error (bad input, named by whoever checked it) is rethrown as it is,
// and so is anything that is no std::exception.
std::string backend_failure_text(std::exception_ptr error);

// The text wait_named puts first: "waiting for allreduce: " + what, or what
// unchanged when it already names the collective. (Split out for the tests.)
std::string name_collective(c10d::OpType op, const std::string& what);

}  // namespace ddpx::comm::detail
