#include "plugin/trainer/hang_report.h"

#include <ddpx/comm.h>

#include <algorithm>
#include <csignal>
#include <iostream>
#include <memory>

#include "plugin/comm/flight_exchange.h"

namespace ddpx::trainer {
namespace {

std::unique_ptr<comm::detail::FrExchange> exchange;
std::chrono::milliseconds grace{0};

}  // namespace

void arm_hang_report(c10d::ProcessGroup& pg, std::chrono::milliseconds timeout) {
  comm::dump_trace_on_signal(SIGUSR1);
  // The others fail the same collective within about the same time; a rank
  // stuck elsewhere answers from its responder within 0.1 s.
  grace =
      std::clamp(timeout / 2, std::chrono::milliseconds(1000), std::chrono::milliseconds(10000));
  exchange = std::make_unique<comm::detail::FrExchange>(
      comm::detail::FrExchange::job_store(pg, timeout), pg.getRank(), pg.getSize());
}

void print_hang_report() {
  if (!exchange) return;
  const std::string screen = exchange->diagnose(grace);
  if (!screen.empty()) std::cerr << "[ddpx-train] " << screen << std::flush;
}

}  // namespace ddpx::trainer
