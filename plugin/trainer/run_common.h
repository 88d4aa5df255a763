#pragma once
// What both kinds of run (GradSync's synchronous one, trainer.cpp, and the
// parameter server's, trainer_ps.cpp) do alike: data, progress text, the
// final evaluation.
#include <torch/script.h>

#include <functional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "plugin/trainer/data.h"
#include "plugin/trainer/model.h"
#include "plugin/trainer/options.h"

namespace ddpx::trainer {

// Processes of this job on this host (for the intra-op thread count).
int local_ranks();

// --device: the CPU, or this process's GPU (local rank mod the host's GPUs),
// made the current CUDA device (NCCL and the caching allocator use it). A
// clear error when CUDA was asked for and none is visible.
at::Device select_device(const Options& o);
// Rows `rows` of `all`, on the device, without waiting for it: selected
// straight into pinned memory, whose copy is queued on the stream while the
// host goes on (a plain .to() synchronizes the stream, so each step's host
// work waited for the last step's device work, NextForward's queued updates
// included; the caching host allocator keeps the pinned block until the
// copy is done).
at::Tensor rows_to(const at::Tensor& all, const at::Tensor& rows, const at::Device& device);

// --data, or the generated set the model takes.
DataSplit load_data(const Options& o, const ScriptedModel& m);

// "h:mm:ss".
std::string eta(double seconds);

// torchrun's TORCHELASTIC_RESTART_COUNT: how many times it has restarted the
// workers (0 on the first start, and outside torchrun).
int elastic_restart();

// A test hook: DDPX_TRAIN_FAIL_AT=STEP:RANK makes rank RANK exit with status
// 1 right after step STEP (and its checkpoint), on the first start only (so
// that a restarted job runs through): a worker failing mid-run, on cue.
void injected_failure(int64_t step, int rank);

// A test hook: DDPX_TRAIN_STALL_AT=STEP:RANK:SECONDS makes rank RANK sleep
// SECONDS in its data path before step STEP (a rank stuck in its data loader
// while the others wait in a collective).
void injected_stall(int64_t step, int rank);

// A test hook: with DDPX_TRAIN_SAMPLE_LOG=PATH each rank appends one JSON
// line per step to PATH.<restart>.<rank>: {"restart", "step", "rank",
// "world", "samples": the training set's indices it trained on}, flushed at
// once (a killed rank keeps what it wrote). Tests account for every sample
// of an epoch across restarts and world sizes with it.
void log_samples(int64_t step, int rank, int world, const at::Tensor& rows);

// --straggler: sleeps the step's delay when `rank` is the slowed one.
void straggle(const Options& o, int rank);

at::Tensor allreduce_sum(c10d::ProcessGroup& pg, at::Tensor t);

// Accuracy of the model on the test set, each rank of pg scoring its share
// (on the device the model's parameters are on).
double evaluate(torch::jit::Module& m, const Dataset& test, c10d::ProcessGroup& pg, int64_t batch);
// The same for a group that is not a ProcessGroup (the parameter server's
// final ranks): this rank's shard of the test set, summed with `sum` (float64).
double evaluate(torch::jit::Module& m, const Dataset& test, int rank, int size,
                const std::function<at::Tensor(const at::Tensor&)>& sum, int64_t batch);

}  // namespace ddpx::trainer
