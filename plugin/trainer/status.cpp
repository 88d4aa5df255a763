#include "plugin/trainer/status.h"

#include <cstdlib>
#include <fstream>
#include <utility>

#include "plugin/trainer/checkpoint.h"  // write_durably

namespace ddpx::trainer {
namespace {

// This process's rank as its launcher set it, before MPI or c10d start.
int launcher_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK"}) {
    if (const char* v = std::getenv(var)) return std::atoi(v);
  }
  return 0;
}

}  // namespace

JobStatus::JobStatus(std::string path) : path_(std::move(path)) {
  if (launcher_rank() == 0) write("running");
}

void JobStatus::write(const std::string& line) const {
  if (path_.empty()) return;
  write_durably(path_, line + "\n");
}

void JobStatus::fail(const std::string& reason) const {
  if (path_.empty()) return;
  std::ifstream f(path_);
  std::string first;
  if (f && std::getline(f, first) && first.rfind("failed:", 0) == 0) return;
  write("failed: " + reason);
}

}  // namespace ddpx::trainer
