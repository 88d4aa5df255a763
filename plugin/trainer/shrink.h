#pragma once
// ddpx-train --on-rank-loss shrink: when a rank dies or freezes under mpirun
// (recovery mode), the ranks left agree on who they are, make a group of
// their own and go on from the most advanced one's state, each taking its
// slice of the same global batches (trainer.cpp rebuilds GradSync over the
// new group and shares the state; this file decides who is left).
#include <ddpx/comm.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "plugin/trainer/options.h"

namespace ddpx::trainer {

// At start, on every rank: what shrinking needs, as clear errors (the
// launcher, mpirun's recovery mode, --global-batch, --overlap none, one
// channel, at least --min-ranks ranks). Nothing when --on-rank-loss abort.
void check_shrink_options(const Options& o, int world);

// Where each rank runs (world rank -> host and pid), gathered at start:
// the survivors end a lost rank on their own host (a frozen one would
// otherwise hold mpirun for ever, and wake to report a failure).
struct Procs {
  std::vector<int64_t> host;  // a hash of the host's name
  std::vector<int64_t> pid;
};
Procs gather_procs(c10d::ProcessGroup& pg);

struct Shrunk {
  comm::ProcessGroupPtr pg;  // the survivors' group
  int leader = 0;            // its rank whose state everyone takes (most steps done)
  std::vector<int> lost;     // world ranks lost in this event
  double agree_s = 0;        // the agreement and the new group, in seconds
};

// After step `progress` failed with `why`: agree with the other `members`
// (world ranks; updated to the survivors) and make their group. Throws a
// c10::Error naming the ranks when fewer than --min-ranks are left.
Shrunk shrink_after_loss(const Options& o, const std::string& why, std::vector<int>& members,
                         int64_t progress, std::chrono::milliseconds timeout, const Procs& procs);

}  // namespace ddpx::trainer
