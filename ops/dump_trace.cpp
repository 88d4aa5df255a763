// ddpx::dump_trace(str path="") -> str and ddpx::dump_trace_on_signal(int
// signo): the flight recorder's dump (ddpx::comm::dump_trace, comm.h) for
// Python (ddpx.distributed.dump_trace) and TorchScript.
#include <ddpx/comm.h>
#include <torch/library.h>

namespace ddpx {

TORCH_LIBRARY_FRAGMENT(ddpx, m) {
  m.def("dump_trace(str path=\"\") -> str",
        [](const std::string& path) { return comm::dump_trace(path); });
  m.def("dump_trace_on_signal(int signo) -> ()",
        [](int64_t signo) { comm::dump_trace_on_signal(static_cast<int>(signo)); });
}

}  // namespace ddpx
