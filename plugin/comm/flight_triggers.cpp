// When the flight recorder (flight_recorder.h) is written out: on request
// (ddpx::comm::dump_trace, ddpx.distributed.dump_trace), on a signal
// (dump_trace_on_signal: ddpx-train's SIGUSR1), and once per process when a
// collective times out or fails, as PyTorch's TORCH_FR_DUMP_ON_TIMEOUT says
// (default on).
#include "plugin/comm/flight_triggers.h"

#include <c10/util/Exception.h>
#include <ddpx/comm.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <thread>

#include "plugin/comm/flight_dump.h"

namespace ddpx::comm {
namespace detail {
namespace {

int fr_env_int(const char* name, int def) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : def;
}

// The self-pipe of dump_trace_on_signal: the handler writes a byte, a thread
// reads it and dumps (writing a file is not async-signal-safe).
int signal_pipe[2] = {-1, -1};

extern "C" void on_dump_signal(int) {
  const char byte = 1;
  const int saved = errno;
  if (signal_pipe[1] >= 0) (void)!write(signal_pipe[1], &byte, 1);
  errno = saved;
}

}  // namespace

int fr_process_rank() {
  // The launcher's world rank: mpirun's, else torchrun's (PyTorch names its
  // dump files by the global rank too).
  return fr_env_int("OMPI_COMM_WORLD_RANK", fr_env_int("PMI_RANK", fr_env_int("RANK", 0)));
}

std::string fr_current_dump() {
  return fr_dump_bytes(FlightRecorder::get().snapshot(), fr_process_rank(), "ddpx");
}

void fr_dump_after_failure(const std::string& why) {
  static std::atomic<bool> done{false};
  if (!FlightRecorder::get().enabled() || !fr_dump_on_timeout() || done.exchange(true)) return;
  try {
    const std::string path = dump_trace();
    std::cerr << "[ddpx] " << why << ": flight recorder written to " << path << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "[ddpx] " << why << ": the flight recorder could not be written: " << e.what()
              << std::endl;
  }
}

}  // namespace detail

std::string dump_trace(const std::string& path) {
  using namespace detail;
  const std::string to = path.empty() ? fr_dump_prefix() + std::to_string(fr_process_rank()) : path;
  fr_write_file(to, fr_current_dump());
  return to;
}

void dump_trace_on_signal(int signo) {
  using namespace detail;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (signal_pipe[0] < 0) {
    TORCH_CHECK(pipe2(signal_pipe, O_CLOEXEC) == 0,
                "dump_trace_on_signal: pipe: ", std::strerror(errno));
    std::thread([] {
      for (;;) {
        char byte = 0;
        const ssize_t n = read(signal_pipe[0], &byte, 1);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        try {
          const std::string path = dump_trace();
          std::cerr << "[ddpx] signal: flight recorder written to " << path << std::endl;
        } catch (const std::exception& e) {
          std::cerr << "[ddpx] signal: the flight recorder could not be written: " << e.what()
                    << std::endl;
        }
      }
    }).detach();
  }
  struct sigaction sa {};
  sa.sa_handler = on_dump_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  TORCH_CHECK(sigaction(signo, &sa, nullptr) == 0, "dump_trace_on_signal: signal ", signo, ": ",
              std::strerror(errno));
}

}  // namespace ddpx::comm
