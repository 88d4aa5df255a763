#include "plugin/comm/member_id.h"

#include <c10/util/Exception.h>

#include <charconv>

namespace ddpx::comm::detail {

int parse_member_id(const std::string& id, const std::string& job, int world_size,
                    const char* call) {
  const auto colon = id.rfind(':');
  TORCH_CHECK(colon != std::string::npos && colon + 1 < id.size(), "ddpx_mpi: ", call, ": '", id,
              "' is not a ddpx_mpi member id (job:world_rank)");
  TORCH_CHECK(id.compare(0, colon, job) == 0 && colon == job.size(), "ddpx_mpi: ", call, ": '", id,
              "' belongs to another MPI job (this one is ", job,
              "); MPI joins the processes of one job only");
  // Digits only, all of them: "job:1x" or "job: 1" is not an id.
  int rank = -1;
  const char* first = id.data() + colon + 1;
  const char* last = id.data() + id.size();
  const auto [end, err] = std::from_chars(first, last, rank);
  TORCH_CHECK(err == std::errc() && end == last && *first != '-', "ddpx_mpi: ", call, ": '", id,
              "' has no world rank after its job (job:world_rank, a number)");
  TORCH_CHECK(rank < world_size, "ddpx_mpi: ", call, ": member id '", id, "' names world rank ",
              rank, ", out of range for a world of size ", world_size);
  return rank;
}

}  // namespace ddpx::comm::detail
