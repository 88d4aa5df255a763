#pragma once
// Checkpoints of a ddpx-train run: model parameters and buffers, optimizer
// state, GradSync's learnt state (bucket plan order, order predictor, the
// float32 masters of --param-dtype), the loss scaler's state, the
// data position and the RNG -- everything a resumed run needs to continue
// bit for bit as if it had never stopped.
//
// Only rank 0 writes (every rank holds the same state after a synced step,
// except a lossy codec's error-feedback residuals: rank 0 gathers every
// rank's, and each takes its own back on resume; PowerSGD's warm starts are
// the same on every rank and saved once), to a temporary file that
// is flushed to disk and then renamed over the old checkpoint, so a crash at
// any moment leaves the previous checkpoint whole.
// On resume rank 0 reads the file and broadcasts its bytes, so ranks on other
// hosts need no shared filesystem.
#include <ddpx/amp.h>
#include <ddpx/grad_sync.h>
#include <torch/optim/optimizer.h>
#include <torch/script.h>

#include <cstdint>
#include <string>
#include <vector>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "plugin/trainer/options.h"

namespace ddpx::trainer {

struct Position {
  int64_t step = 0;   // optimizer steps taken
  int64_t epoch = 0;  // epoch of the next batch
  int64_t batch = 0;  // next batch within that epoch
};

struct TrainObjects {
  torch::jit::Module& model;
  torch::optim::Optimizer& optimizer;
  std::string optimizer_kind;  // --optimizer: a state of another kind does not load
  GradSync& sync;
  // LayerDrop::describe() of the run: its pattern is a function of the step,
  // so a resumed run continues it only under the same schedule and seed.
  std::string layer_drop = "none";
  // Where the model trains (--device). The file holds CPU tensors, so a run
  // resumes on another device or GPU number than the one that wrote it.
  at::Device device = at::kCPU;
  // This process's place in the job: which row of the saved residuals is its.
  int rank = 0;
  int world = 1;
  // Samples per step over all ranks: the data position counts steps of this
  // many, so a run resumes (at any world size) only with the same.
  int64_t samples_per_step = 0;
  // Loss scaling (--amp fp16, --param-dtype fp16): its state is in the file
  // (null: none; a file with one resumes only with one, and the reverse).
  GradScaler* scaler = nullptr;
  // --shard: each rank holds its part of the optimizer state; a checkpoint
  // holds every rank's (GradSync::optimizer_shard), re-split on resume.
  bool sharded = false;
};

// Collective: refuses (on every rank) to start a fresh run over an existing
// checkpoint at o.checkpoint (rank 0 looks, so ranks on other hosts agree).
void refuse_to_overwrite(const Options& o, c10d::ProcessGroup& pg);

// Collective (the residuals are gathered); rank 0 writes.
void save_checkpoint(const std::string& path, c10d::ProcessGroup& pg, TrainObjects& t,
                     const Position& pos);

// The checkpoint's bytes of this rank's objects: `s` is t.sync's state,
// `residuals` every rank's codec residuals, one row each (undefined: none),
// and `shards` every rank's part of the optimizer state (--shard; empty:
// the optimizer's own state is whole).
std::string serialize(TrainObjects& t, const Position& pos, const GradSync::State& s,
                      const at::Tensor& residuals, const std::vector<std::string>& shards = {});

// Collective: rank `root` of `pg` hands everyone its model, optimizer state,
// GradSync's learnt state, data position and RNG, as a checkpoint would,
// without a file (the survivors of a shrink take the most advanced one's).
// Codec residuals stay each rank's own.
void share_state(c10d::ProcessGroup& pg, int root, TrainObjects& t, Position& pos);

// Writes `bytes` to a temporary file beside `path`, fsyncs it, renames it
// over `path` and fsyncs the directory: a crash leaves the old file or the
// new one, never a part. (Also the parameter server's checkpoints.)
void write_durably(const std::string& path, const std::string& bytes);

// Collective. Returns false (and changes nothing) when `path` does not exist;
// throws a clear error on every rank when it cannot be read or does not fit
// the model.
bool load_checkpoint(const std::string& path, c10d::ProcessGroup& pg, TrainObjects& t,
                     Position& pos);

// Local: restores a checkpoint's bytes (`name` is its file, for messages)
// into `t` and `pos`; load_checkpoint's parser, which tests/fuzz drives.
// Throws a c10::Error naming the file when the bytes are not a checkpoint of
// this run's model and optimizer.
void restore_checkpoint(const char* data, size_t size, const std::string& name, TrainObjects& t,
                        Position& pos);

}  // namespace ddpx::trainer
