// Library-level registration that is not an op: the companion libraries.
//
// Inside a Python process, load the Python glue (libddpx_python.so, next to
// this library) so that torch.ops.load_library alone registers ddpx_mpi with
// torch.distributed. C++ programs have no Python and skip this; the glue is a
// separate library so libddpx.so itself never links libpython.
//
// The CUDA kernels are a companion too (libddpx_cuda.so, built where nvcc is
// found): they register the ops' CUDA kernels when it is loaded, here, if it
// sits next to this library. Compiling them takes 250 compile-seconds on our
// 2-core machine (everything else the main job needs: 689), so
// scripts/run.sh builds them only where a GPU is present (scripts/test.sh
// always does); without them a CUDA tensor reaching a ddpx op is the
// dispatcher's error naming the CUDA backend.
#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>
#include <string>

namespace {

void marker() {}

// The path of `name` in this library's directory ("" if unknown).
std::string beside_this_library(const char* name) {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&marker), &info) || info.dli_fname == nullptr) return "";
  const std::string self = info.dli_fname;
  return self.substr(0, self.find_last_of('/') + 1) + name;
}

void load(const std::string& path, const char* without) {
  if (dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL) == nullptr) {
    std::fprintf(stderr, "ddpx: %s: %s\n", without, dlerror());
  }
}

struct LoadCompanions {
  LoadCompanions() {
    const std::string cuda = beside_this_library("libddpx_cuda.so");
    if (!cuda.empty() && access(cuda.c_str(), F_OK) == 0) {
      load(cuda, "the CUDA kernels are not registered");
    }
    using IsInit = int (*)();
    auto is_init = reinterpret_cast<IsInit>(dlsym(RTLD_DEFAULT, "Py_IsInitialized"));
    if (is_init == nullptr || is_init() == 0) return;
    const std::string glue = beside_this_library("libddpx_python.so");
    if (!glue.empty()) load(glue, "ddpx_mpi is not registered with torch.distributed");
  }
} load_companions;

}  // namespace
