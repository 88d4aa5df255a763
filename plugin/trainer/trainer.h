#pragma once
// One ddpx-train run: process group, scripted model, data shard, optimizer,
// GradSync, the step loop with progress, metrics, checkpoints and the final
// evaluation. Throws on any error (the caller ends the job).
#include "plugin/trainer/options.h"

namespace ddpx::trainer {

void run(const Options& o);

}  // namespace ddpx::trainer
