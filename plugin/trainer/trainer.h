#pragma once
// One ddpx-train run: process group, scripted model, data shard, optimizer,
// GradSync, the step loop with progress, metrics, checkpoints and the final
// evaluation. Throws on any error (the caller ends the job).
#include <string>

#include "plugin/trainer/options.h"

namespace ddpx::trainer {

// Returns the job's outcome as the lead rank sees it at the end ("ok", or
// "ok, ranks lost: 2 3"; status.h), "" on the other ranks.
std::string run(const Options& o);

// --mode ps (trainer_ps.cpp): the same model, data, progress lines, metrics
// and final test accuracy, trained through ddpx::ps; the same outcome.
std::string run_ps(const Options& o);

}  // namespace ddpx::trainer
