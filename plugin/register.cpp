// Library-level registration that is not an op.
//
// Inside a Python process, load the Python glue (libddpx_python.so, next to
// this library) so that torch.ops.load_library alone registers ddpx_mpi with
// torch.distributed. C++ programs have no Python and skip this; the glue is a
// separate library so libddpx.so itself never links libpython.
#include <dlfcn.h>

#include <cstdio>
#include <string>

namespace {

struct LoadPythonGlue {
  LoadPythonGlue() {
    using IsInit = int (*)();
    auto is_init = reinterpret_cast<IsInit>(dlsym(RTLD_DEFAULT, "Py_IsInitialized"));
    if (is_init == nullptr || is_init() == 0) return;
    Dl_info info{};
    if (!dladdr(reinterpret_cast<void*>(&marker), &info) || info.dli_fname == nullptr) return;
    std::string path = info.dli_fname;
    path = path.substr(0, path.find_last_of('/') + 1) + "libddpx_python.so";
    if (dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL) == nullptr) {
      std::fprintf(stderr, "ddpx: ddpx_mpi is not registered with torch.distributed: %s\n",
                   dlerror());
    }
  }
  static void marker() {}
} load_python_glue;

}  // namespace
