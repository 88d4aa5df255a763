#pragma once
// The sentence a failed collective's diagnosis ends in, for both ways of
// asking the peers: ddpx_mpi's (MPI messages on a spare communicator) and the
// store roll call (Gloo, NCCL). One wording, so that a log reads the same
// whichever backend the job ran on.
#include <chrono>
#include <string>
#include <vector>

namespace ddpx::comm::detail {

// "1", "1 and 2", "1, 2 and 4".
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) {
    s += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
  }
  return s;
}

// silent: ranks that never answered within `grace` (`silent_why` says what
// that can mean); elsewhere: ranks that answered from a different call
// (`elsewhere_what` says which). Empty lists: everyone answered alike.
inline std::string peer_report(const std::vector<int>& silent, const std::vector<int>& elsewhere,
                               std::chrono::milliseconds grace, const std::string& silent_why,
                               const std::string& elsewhere_what) {
  std::string out;
  if (!silent.empty()) {
    out = (silent.size() == 1 ? "rank " : "ranks ") + rank_list(silent) +
          " of this group did not answer within " + std::to_string(grace.count()) + " ms (" +
          silent_why + ")";
  }
  if (!elsewhere.empty()) {
    out += (out.empty() ? "" : "; ") + std::string(elsewhere.size() == 1 ? "rank " : "ranks ") +
           rank_list(elsewhere) + " " + elsewhere_what;
  }
  if (out.empty()) {
    out = "every rank answered and is waiting too: the transfer itself stalled, or a send has "
          "no matching receive";
  }
  return out;
}

}  // namespace ddpx::comm::detail
