#pragma once
// ddpx_mpi's member ids, "job:world_rank": how a process names itself to
// processes it shares no communicator with yet (merge's store entries,
// reconfigure's handles). They arrive from other processes, so they are
// parsed as outside input: anything that is not an id of this job is an
// error naming it, never an exception of the standard library.
#include <string>

namespace ddpx::comm::detail {

// The world rank in `id`, which must be of MPI job `job` and name a rank in
// [0, world_size). `call` ("merge()", ...) prefixes the error.
int parse_member_id(const std::string& id, const std::string& job, int world_size,
                    const char* call);

}  // namespace ddpx::comm::detail
