#pragma once
// One ddpx-train run: process group, scripted model, data shard, optimizer,
// GradSync, the step loop with progress, metrics, checkpoints and the final
// evaluation. Throws on any error (the caller ends the job).
#include "plugin/trainer/options.h"

namespace ddpx::trainer {

void run(const Options& o);

// --mode ps (trainer_ps.cpp): the same model, data, progress lines, metrics
// and final test accuracy, trained through ddpx::ps.
void run_ps(const Options& o);

}  // namespace ddpx::trainer
