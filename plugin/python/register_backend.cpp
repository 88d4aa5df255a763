// Python glue, loaded by libddpx.so only inside a Python process (see
// plugin/register.cpp). It creates ddpx._C (fast_ops.cpp), and
// torch.ops.load_library("libddpx.so") then makes
//   torch.distributed.init_process_group(backend="ddpx_mpi")
// work under mpirun with a stock wheel. It
//   1. registers the ddpx_mpi creator with torch.distributed.Backend, and
//   2. wraps the env:// rendezvous: under mpirun without MASTER_ADDR, rank and
//      world size come from MPI and the store from store_over_mpi(); any other
//      launch goes to torch's own handler unchanged.
#include <ddpx/comm.h>
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdio>
#include <cstdlib>

#include "plugin/comm/mpi_env.h"
#include "plugin/comm/mpi_store.h"
#include "plugin/comm/mpi_work.h"
#include "plugin/python/fast_ops.h"

namespace py = pybind11;

namespace {

std::chrono::milliseconds timeout_from(const py::object& td) {
  // DDPX_TIMEOUT_S, when set, is the operator's explicit choice and wins.
  if (std::getenv("DDPX_TIMEOUT_S") != nullptr || td.is_none()) {
    return ddpx::comm::default_timeout();
  }
  return td.cast<std::chrono::milliseconds>();
}

ddpx::comm::BackendPtr create_ddpx_mpi(const py::object& opts, const py::object& /*backend_opts*/) {
  const int group_rank = opts.attr("group_rank").cast<int>();
  const int group_size = opts.attr("group_size").cast<int>();
  std::vector<int> ranks;
  for (auto r : opts.attr("global_ranks_in_group")) ranks.push_back(r.cast<int>());
  const auto timeout = timeout_from(opts.attr("timeout"));
  ddpx::comm::BackendPtr backend;
  {
    py::gil_scoped_release no_gil;  // communicator creation is collective
    backend = ddpx::comm::make_mpi_backend(ranks, timeout);
  }
  TORCH_CHECK(
      backend->getSize() == group_size && (group_rank < 0 || backend->getRank() == group_rank),
      "ddpx_mpi: torch.distributed asked for rank ", group_rank, " of ", group_size,
      " but MPI gives rank ", backend->getRank(), " of ", backend->getSize(),
      "; launch with mpirun and let ddpx_mpi take rank and world size from MPI");
  return backend;
}

void install() {
  auto dist = py::module_::import("torch.distributed");
  if (!dist.attr("is_available")().cast<bool>()) return;
  auto backend_cls = dist.attr("Backend");
  if (py::hasattr(backend_cls, "DDPX_MPI")) return;  // a second load_library
  backend_cls.attr("register_backend")(
      "ddpx_mpi", py::cpp_function(&create_ddpx_mpi), py::arg("extended_api") = true,
      py::arg("devices") = std::vector<std::string>{"cpu", "cuda"});

  auto rdzv = py::module_::import("torch.distributed.rendezvous");
  py::dict handlers = rdzv.attr("_rendezvous_handlers");
  py::object torch_env = handlers["env"];
  handlers["env"] = py::cpp_function([torch_env](py::object url, py::kwargs kwargs) -> py::object {
    if (!ddpx::comm::detail::launched_by_mpi() || std::getenv("MASTER_ADDR") != nullptr) {
      return torch_env(url, **kwargs);
    }
    py::object td = py::none();
    if (kwargs.contains("timeout")) td = py::object(kwargs["timeout"]);
    const auto timeout = timeout_from(td);
    c10::intrusive_ptr<c10d::Store> store;
    int rank = 0, size = 1;
    {
      py::gil_scoped_release no_gil;
      auto& env = ddpx::comm::detail::MpiEnv::get();
      rank = env.world_rank();
      size = env.world_size();
      store = ddpx::comm::detail::store_over_mpi(rank, size, timeout);
    }
    py::list one;
    one.append(py::make_tuple(py::cast(store), rank, size));
    return py::iter(one);
  });

  // Our threads must let go of every Work before the interpreter finalises:
  // a Work can hold the last reference to a tensor whose Python object needs
  // the GIL to be freed, and a thread asking a finalising interpreter for it
  // is ended mid-destructor (std::terminate, "terminate called without an
  // active exception"). atexit callbacks run while other threads may still
  // take the GIL; the wait releases it so that they can.
  py::module_::import("atexit").attr("register")(py::cpp_function([] {
    py::gil_scoped_release no_gil;
    ddpx::comm::detail::quiesce(std::chrono::seconds(5));
  }));
}

struct Installer {
  Installer() {
    py::gil_scoped_acquire gil;
    try {
      ddpx::python::install_fast_ops();
    } catch (const std::exception& e) {
      // ddpx.ops and ddpx.nn then call torch.ops.ddpx.* (correct, slower).
      std::fprintf(stderr, "ddpx: could not create ddpx._C: %s\n", e.what());
    }
    try {
      install();
    } catch (py::error_already_set& e) {
      std::fprintf(stderr, "ddpx: could not register ddpx_mpi with torch.distributed: %s\n",
                   e.what());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ddpx: could not register ddpx_mpi with torch.distributed: %s\n",
                   e.what());
    }
  }
} installer;

}  // namespace
