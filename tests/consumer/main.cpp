// Uses the installed ddpx the way a C++ trainer does: a process group from
// the environment and a collective through it, plus the version op.
#include <ddpx/ddpx.h>

#include <iostream>

int main() {
  auto pg = ddpx::comm::init_from_env();  // one process: a one-rank Gloo group
  std::vector<at::Tensor> t{at::arange(4, at::kFloat)};
  pg->allreduce(t)->wait();
  if (!at::equal(t[0], at::arange(4, at::kFloat))) return 1;
  std::cout << "ddpx " << ddpx::version() << " consumer ok (" << pg->getSize() << " rank)\n";
  return 0;
}
