#pragma once
// Backends register a creator under their name from their own file (adding a
// transport is adding a file); make() picks one at run time.
#include <ddpx/comm.h>

#include <functional>
#include <string>
#include <vector>

namespace ddpx::comm::detail {

struct BackendArgs {
  c10::intrusive_ptr<c10d::Store> store;  // null for ddpx_mpi
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{};
  std::string name;
};

struct BackendEntry {
  std::string name;
  c10d::ProcessGroup::BackendType type;
  bool needs_store;
  std::function<BackendPtr(const BackendArgs&)> create;
};

bool register_backend(BackendEntry entry);
const BackendEntry* find_backend(const std::string& name);
std::vector<std::string> backend_names();

}  // namespace ddpx::comm::detail
