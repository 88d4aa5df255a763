// ddpx::comm: the backend registry, launcher detection and process-group
// construction (init_from_env / make).
#include <c10/util/Exception.h>
#include <c10/util/env.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "plugin/comm/backend_registry.h"
#include "plugin/comm/mpi_env.h"
#include "plugin/comm/mpi_store.h"

namespace ddpx::comm {
namespace detail {
namespace {

std::map<std::string, BackendEntry>& registry() {
  static std::map<std::string, BackendEntry> r;
  return r;
}
std::mutex& registry_mu() {
  static std::mutex m;
  return m;
}

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int env_int(const char* name) {
  auto v = env(name);
  TORCH_CHECK(v.has_value(), "ddpx: environment variable ", name, " is not set");
  try {
    return std::stoi(*v);
  } catch (const std::exception&) {
    TORCH_CHECK(false, "ddpx: environment variable ", name, "='", *v, "' is not an integer");
  }
}

}  // namespace

// Under mpirun there is no MASTER_ADDR: rank 0 serves a TCPStore on a free
// port and announces host:port to the others over ddpx_mpi.
c10::intrusive_ptr<c10d::Store> store_over_mpi(int rank, int size,
                                               std::chrono::milliseconds timeout) {
  std::string host = env("DDPX_MASTER_ADDR").value_or(env("MASTER_ADDR").value_or(""));
  if (host.empty()) {
    char name[256] = {0};
    gethostname(name, sizeof(name) - 1);
    host = name;
  }
  c10d::TCPStoreOptions o;
  o.isServer = rank == 0;
  o.port = 0;
  o.numWorkers = size;
  o.waitWorkers = false;
  o.timeout = timeout;
  c10::intrusive_ptr<c10d::TCPStore> server;
  // [port, host bytes...] broadcast from rank 0 as int64s.
  auto msg = at::zeros({1 + 256}, at::kLong);
  if (rank == 0) {
    server = c10::make_intrusive<c10d::TCPStore>(host, o);
    msg[0] = static_cast<int64_t>(server->getPort());
    for (size_t i = 0; i < host.size() && i < 255; ++i) msg[1 + i] = host[i];
  }
  auto bootstrap = make_mpi_backend({}, timeout);
  std::vector<at::Tensor> t{msg};
  bootstrap->broadcast(t, c10d::BroadcastOptions{})->wait();
  if (rank == 0) return server;
  std::string h;
  for (int i = 1; i < 257 && msg[i].item<int64_t>() != 0; ++i) {
    h.push_back(static_cast<char>(msg[i].item<int64_t>()));
  }
  o.port = static_cast<uint16_t>(msg[0].item<int64_t>());
  return c10::make_intrusive<c10d::TCPStore>(h, o);
}

namespace {

// torchrun: MASTER_ADDR/MASTER_PORT, rank 0 hosts the store.
c10::intrusive_ptr<c10d::Store> store_from_torchrun(int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions o;
  o.isServer = rank == 0;
  o.port = static_cast<uint16_t>(env_int("MASTER_PORT"));
  o.numWorkers = size;
  o.timeout = timeout;
  // torchrun's agent already serves the store on MASTER_PORT.
  const bool agent_store = env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  if (agent_store) o.isServer = false;
  auto store = c10::make_intrusive<c10d::TCPStore>(env("MASTER_ADDR").value_or("127.0.0.1"), o);
  if (!agent_store) return store;
  // The agent's store outlives the workers: after a restart the keys of the
  // last attempt (a dead rank's Gloo address) are still in it. Each attempt
  // works under a prefix of its own, as torch.distributed's env:// does.
  return c10::make_intrusive<c10d::PrefixStore>(
      "/worker/attempt_" + env("TORCHELASTIC_RESTART_COUNT").value_or("0"), store);
}

}  // namespace

bool register_backend(BackendEntry entry) {
  std::lock_guard<std::mutex> lock(registry_mu());
  registry()[entry.name] = std::move(entry);
  return true;
}

const BackendEntry* find_backend(const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mu());
  auto it = registry().find(name);
  return it == registry().end() ? nullptr : &it->second;
}

std::vector<std::string> backend_names() {
  std::lock_guard<std::mutex> lock(registry_mu());
  std::vector<std::string> v;
  for (const auto& [k, _] : registry()) v.push_back(k);
  return v;
}

bool stages_through_host(c10d::ProcessGroup& pg, c10::DeviceType type) {
  const auto types = pg.getDeviceTypes();
  const auto serves = [&](c10::DeviceType t) {
    return std::find(types.begin(), types.end(), t) != types.end();
  };
  if (type == c10::DeviceType::CPU || !serves(type) || !serves(c10::DeviceType::CPU)) return false;
  const BackendEntry* entry = find_backend(pg.getBackend(type)->getBackendName());
  return entry != nullptr && entry->host_only && entry->host_only();
}

}  // namespace detail

std::chrono::milliseconds default_timeout() {
  if (auto v = detail::env("DDPX_TIMEOUT_S")) {
    double s = 0;
    try {
      s = std::stod(*v);
    } catch (const std::exception&) {
      TORCH_CHECK(false, "ddpx: DDPX_TIMEOUT_S='", *v, "' is not a number of seconds");
    }
    TORCH_CHECK(s > 0, "ddpx: DDPX_TIMEOUT_S must be positive, got ", *v);
    return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
  }
  return std::chrono::minutes(30);
}

Launcher detect_launcher() {
  if (detail::launched_by_mpi()) return Launcher::Mpi;
  if (detail::env("RANK") && detail::env("WORLD_SIZE") && detail::env("MASTER_ADDR")) {
    return Launcher::Torchrun;
  }
  return Launcher::None;
}

std::vector<std::string> available_backends() { return detail::backend_names(); }

std::string process_label() {
  std::string rank = "?", size = "?";
  for (const auto& [r, s] : {std::pair{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
                             std::pair{"PMI_RANK", "PMI_SIZE"}, std::pair{"RANK", "WORLD_SIZE"}}) {
    if (auto v = detail::env(r)) {
      rank = *v;
      size = detail::env(s).value_or("?");
      break;
    }
  }
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  return "rank " + rank + " of " + size + " on " + host;
}

void abort_job(int code) {
  std::cout.flush();
  std::cerr.flush();
  int initialised = 0, finalised = 0;
  MPI_Initialized(&initialised);
  MPI_Finalized(&finalised);
  if (detail::launched_by_mpi() && initialised && !finalised) {
    // MPI_Abort asks mpirun to end the job; with the network to it cut too
    // (tests/python/test_trainer_network.py) it never returns. Leave on our
    // own after a grace: mpirun sees this rank exit and ends the others.
    std::thread([code] {
      std::this_thread::sleep_for(std::chrono::seconds(5));
      std::_Exit(code);
    }).detach();
    MPI_Abort(MPI_COMM_WORLD, code);
  }
  std::_Exit(code);
}

ProcessGroupPtr make(const std::string& spec, const MakeOptions& opts) {
  // "gloo" or "cpu:gloo,cuda:nccl" -> device type -> backend name.
  std::vector<std::pair<c10::DeviceType, std::string>> plan;
  if (spec.find(':') == std::string::npos) {
    plan = {{c10::DeviceType::CPU, spec}, {c10::DeviceType::CUDA, spec}};
  } else {
    std::stringstream ss(spec);
    std::string item;
    while (std::getline(ss, item, ',')) {
      auto colon = item.find(':');
      TORCH_CHECK(colon != std::string::npos, "ddpx: backend spec '", spec,
                  "' must be a name or device:name pairs, e.g. cpu:gloo,cuda:nccl");
      plan.emplace_back(c10::Device(item.substr(0, colon)).type(), item.substr(colon + 1));
    }
  }
  for (const auto& [dev, name] : plan) {
    TORCH_CHECK(detail::find_backend(name) != nullptr, "ddpx: unknown backend '", name,
                "'; this build has: ", c10::Join(", ", available_backends()));
  }

  const Launcher launcher = detect_launcher();
  int rank = opts.rank, size = opts.size;
  if (rank < 0 || size < 0) {
    if (launcher == Launcher::Mpi) {
      rank = detail::MpiEnv::get().world_rank();
      size = detail::MpiEnv::get().world_size();
    } else if (launcher == Launcher::Torchrun) {
      rank = detail::env_int("RANK");
      size = detail::env_int("WORLD_SIZE");
    } else {
      rank = 0;
      size = 1;
    }
  }
  c10::intrusive_ptr<c10d::Store> store = opts.store;
  bool needs_store = false;
  for (const auto& [dev, name] : plan) needs_store |= detail::find_backend(name)->needs_store;
  if (!store && needs_store) {
    if (size == 1) {
      store = c10::make_intrusive<c10d::HashStore>();
    } else if (launcher == Launcher::Mpi) {
      store = detail::store_over_mpi(rank, size, opts.timeout);
    } else {
      store = detail::store_from_torchrun(rank, size, opts.timeout);
    }
  }
  if (!store) store = c10::make_intrusive<c10d::HashStore>();
  store = c10::make_intrusive<c10d::PrefixStore>(opts.name, store);

  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  std::map<std::string, BackendPtr> made;  // one backend object per name
  for (const auto& [dev, name] : plan) {
    const auto* entry = detail::find_backend(name);
    auto& be = made[name];
    if (!be) {
      be = entry->create({c10::make_intrusive<c10d::PrefixStore>(name, store), rank, size,
                          opts.timeout, opts.name});
      TORCH_CHECK(be->getRank() == rank && be->getSize() == size, "ddpx: backend ", name,
                  " reports rank ", be->getRank(), " of ", be->getSize(), ", expected ", rank,
                  " of ", size);
    }
    pg->setBackend(dev, entry->type, be);
  }
  pg->setDefaultBackend(detail::find_backend(plan.front().second)->type);
  pg->setGroupName(opts.name);
  return pg;
}

ProcessGroupPtr init_from_env(std::chrono::milliseconds timeout) {
  MakeOptions opts;
  opts.timeout = timeout;
  switch (detect_launcher()) {
    case Launcher::Mpi:
      return make("ddpx_mpi", opts);
    case Launcher::Torchrun:
    case Launcher::None:
      break;
  }
  const bool nccl = detail::find_backend("nccl") != nullptr && at::hasCUDA();
  return make(nccl ? "cpu:gloo,cuda:nccl" : "gloo", opts);
}

}  // namespace ddpx::comm
