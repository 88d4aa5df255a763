#pragma once
// What a Session holds, for the server and worker files.
#include <ATen/core/Tensor.h>
#include <ddpx/ps.h>
#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "plugin/ps/layout.h"
#include "plugin/ps/local_link.h"

namespace ddpx::ps {

struct Session::State {
  Options opts;
  Consistency consistency;
  std::vector<at::Tensor> params;
  detail::Layout layout;
  // Two duplicates of MPI_COMM_WORLD, one per direction, so that a rank that
  // both serves and trains (colocated) never has its server's any-source
  // probe take a reply meant for its worker: comm carries what workers send
  // servers (PUSH, PULL, BYE, HEARTBEAT), wcomm what servers send workers
  // (REPLY, ERROR, HEARTBEAT, FINAL).
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm wcomm = MPI_COMM_NULL;
  MPI_Comm servers_comm = MPI_COMM_NULL;  // the servers alone (MPI_COMM_NULL on a worker)
  // The ranks that finish together (step 7): comm itself, or a communicator
  // without the workers the servers dropped. MPI_COMM_NULL until agreed.
  MPI_Comm final_comm = MPI_COMM_NULL;
  std::vector<int32_t> lost;    // per worker: 1 once a server dropped it (server side, then agreed)
  std::vector<int> lost_ranks;  // after the agreement: the world ranks left out
  int rank = 0, size = 0;
  int servers = 0, workers = 0;  // K and N (colocated: both the world size)
  bool colocated = false;
  double timeout_s = 0;
  // Colocated: this rank's worker and server, without MPI.
  std::unique_ptr<detail::LocalLink> local;

  // Server k is rank k; worker w is rank K + w, or rank w when colocated.
  int worker_rank(int w) const { return colocated ? w : servers + w; }
  // The worker a rank trains as, or -1 for a dedicated server.
  int worker_of(int r) const {
    const int w = colocated ? r : r - servers;
    return w >= 0 && w < workers ? w : -1;
  }
  bool is_local(int rank_) const { return colocated && rank_ == rank; }
};

namespace detail {

// Waits for a nonblocking collective for at most timeout_s; past that, marks
// the job broken (MPI_Abort at exit), leaks `buffers` (MPI may still write
// them) and throws a c10::Error naming `what`.
void await_bounded(MPI_Request& r, double timeout_s, const std::string& what,
                   const std::vector<at::Tensor>& buffers);

// The communicator of step 7, agreed on first use (collective over the
// servers and the workers they did not drop).
MPI_Comm final_comm(Session::State& s);

}  // namespace detail
}  // namespace ddpx::ps
