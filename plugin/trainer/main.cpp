// ddpx-train: runs a TorchScript model data-parallel under mpirun (ddpx_mpi)
// or torchrun (Gloo). See options.cpp for the flags (--help).
#include <ddpx/comm.h>
#include <malloc.h>

#include <cstdlib>
#include <iostream>

#include "plugin/trainer/hang_report.h"
#include "plugin/trainer/options.h"
#include "plugin/trainer/status.h"
#include "plugin/trainer/trainer.h"

namespace {

// glibc moves its mmap threshold up each time a large block is freed, so a
// training loop's per-step buffers drift from mmap into the heap over the
// first thousands of steps and the heap grows by a few MB at a random step
// (scripts/bench/soak: +1.1-1.5% of RSS on HAN between steps 2,300 and
// 7,400). Fixed thresholds at the top of that drift (32 MB, trim at 64 MB)
// settle the heap in the first steps and run as fast; a user's own setting
// (GLIBC_TUNABLES or MALLOC_*_) is left alone.
void settle_malloc() {
  if (std::getenv("GLIBC_TUNABLES") || std::getenv("MALLOC_MMAP_THRESHOLD_") ||
      std::getenv("MALLOC_TRIM_THRESHOLD_"))
    return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
}

}  // namespace

int main(int argc, char** argv) {
  settle_malloc();
  const auto opts = ddpx::trainer::parse_options(argc, argv);
  std::string why;
  try {
    const ddpx::trainer::JobStatus status(opts.status_file);
    try {
      const std::string outcome = ddpx::trainer::run(opts);
      if (!outcome.empty()) status.write(outcome);
      return 0;
    } catch (const c10::DistBackendError& e) {
      // A collective failed: say where every rank was.
      why = e.what_without_backtrace();
      ddpx::trainer::print_hang_report();
    } catch (const c10::Error& e) {
      why = e.what_without_backtrace();
    } catch (const std::exception& e) {
      why = e.what();
    }
    // The first line of the reason: a status is one line.
    status.fail(ddpx::comm::process_label() + ": " + why.substr(0, why.find('\n')));
  } catch (const std::exception& e) {  // the status file itself could not be written
    why += (why.empty() ? "" : "; ") + std::string("--status-file: ") + e.what();
  }
  std::cerr << "ddpx-train (" << ddpx::comm::process_label() << "): error: " << why << std::endl;
  // Peers may be blocked in a collective with this rank: end the whole job
  // now rather than leave them to their timeout.
  ddpx::comm::abort_job(1);
}
