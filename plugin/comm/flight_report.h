#pragma once
// The one-screen diagnosis from the flight recorders of several ranks
// (flight_recorder.h): for each group, each rank's last completed and first
// pending collective, the first sequence number where the ranks disagree
// (op, sizes, dtypes, GradSync's step and bucket), the ranks that are behind
// or never arrived, and those that did not answer at all. The same analysis
// serves ddpx-train after a failed step (buffers gathered over the store)
// and `ddpx-trace analyze DIR` (dump files).
#include <map>
#include <string>
#include <vector>

#include "plugin/comm/flight_recorder.h"

namespace ddpx::comm::detail {

struct FrFinding {
  enum class Kind {
    kMismatch,  // ranks recorded different calls under one sequence number
    kBehind,    // ranks never reached a collective the others are in
    kNoAnswer,  // ranks of the group whose buffer is missing
  };
  Kind kind;
  std::string group;       // the group's name
  uint64_t seq = 0;        // the collective sequence number it concerns (0: none)
  std::vector<int> ranks;  // the ranks at fault (global ranks)
  std::string text;        // one sentence
};

struct FrReport {
  std::vector<FrFinding> findings;  // most telling first
  std::string text;                 // the screen
};

// `by_rank`: the snapshots of the ranks that answered, by global rank.
// `expected`: every global rank of the job (empty: those the groups name).
FrReport fr_analyze(const std::map<int, FrSnapshot>& by_rank, const std::vector<int>& expected);

// "all_reduce 1x[2101] Float", plus "(step 41, bucket 3: fc1.weight, ...)"
// for GradSync's records.
std::string fr_describe(const FrRecord& r, const FrSnapshot& snap);

}  // namespace ddpx::comm::detail
