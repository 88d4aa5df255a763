#include "plugin/ps/heartbeat.h"

#include "plugin/comm/mpi_env.h"
#include "plugin/ps/transport.h"
#include "plugin/ps/wire.h"

namespace ddpx::ps::detail {

Heartbeat::Heartbeat(MPI_Comm comm, int worker, int servers, int skip, double timeout_s)
    : comm_(comm), worker_(worker), servers_(servers), skip_(skip), period_(timeout_s / 4) {
  thread_ = std::thread([this] { loop(); });
}

void Heartbeat::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void Heartbeat::loop() {
  Outbox out(comm_);
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, period_, [&] { return stop_; })) {
    try {
      for (int k = 0; k < servers_; ++k) {
        if (k != skip_) out.send(pack_note(kHeartbeat, worker_, 0), k, kHeartbeat);
      }
      out.progress();
    } catch (const std::exception&) {
      return;  // the main thread meets the same failure and reports it
    }
  }
  // A dead server never takes its heartbeats: give up on them quickly.
  if (!out.drain(std::chrono::seconds(1))) {
    comm::detail::MpiEnv::get().mark_broken("ddpx ps: heartbeats to a server never completed");
  }
}

}  // namespace ddpx::ps::detail
