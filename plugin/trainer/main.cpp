// ddpx-train: runs a TorchScript model data-parallel under mpirun (ddpx_mpi)
// or torchrun (Gloo). See options.cpp for the flags (--help).
#include <ddpx/comm.h>

#include <iostream>

#include "plugin/trainer/options.h"
#include "plugin/trainer/trainer.h"

int main(int argc, char** argv) {
  const auto opts = ddpx::trainer::parse_options(argc, argv);
  try {
    ddpx::trainer::run(opts);
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << "ddpx-train (" << ddpx::comm::process_label() << "): error: "
              << e.what_without_backtrace() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "ddpx-train (" << ddpx::comm::process_label() << "): error: " << e.what()
              << std::endl;
  }
  // Peers may be blocked in a collective with this rank: end the whole job
  // now rather than leave them to their timeout.
  ddpx::comm::abort_job(1);
}
