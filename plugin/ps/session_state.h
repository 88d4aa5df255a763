#pragma once
// What a Session holds, for the server and worker files.
#include <ddpx/ps.h>
#include <mpi.h>

#include "plugin/ps/layout.h"

namespace ddpx::ps {

struct Session::State {
  Options opts;
  Consistency consistency;
  std::vector<at::Tensor> params;
  detail::Layout layout;
  MPI_Comm comm = MPI_COMM_NULL;  // a duplicate of MPI_COMM_WORLD: our tags, our matching
  int rank = 0, size = 0;
  double timeout_s = 0;
};

}  // namespace ddpx::ps
