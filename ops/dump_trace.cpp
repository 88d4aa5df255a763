// ddpx::dump_trace(str path="") -> str and ddpx::dump_trace_on_signal(int
// signo): the flight recorder's dump (ddpx::comm::dump_trace, comm.h) for
// Python (ddpx.distributed.dump_trace) and TorchScript; and
// ddpx::_pause_flight_recorder(bool paused) -> bool, which measures the
// recorder's cost in one process (scripts/bench/flight_recorder).
#include <ddpx/comm.h>
#include <torch/library.h>

#include "plugin/comm/flight_recorder.h"

namespace ddpx {

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  m.def("dump_trace(str path=\"\") -> str",
        [](const std::string& path) { return comm::dump_trace(path); });
  m.def("dump_trace_on_signal(int signo) -> ()",
        [](int64_t signo) { comm::dump_trace_on_signal(static_cast<int>(signo)); });
  m.def("_pause_flight_recorder(bool paused) -> bool",
        [](bool paused) { return comm::detail::FlightRecorder::get().set_paused(paused); });
}

}  // namespace ddpx
