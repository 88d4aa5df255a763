#pragma once
// ddpx-train's command line: every knob of a run, parsed by CLI11.
#include <cstdint>
#include <string>

namespace ddpx::trainer {

// --servers colocated: every rank trains and serves a shard (ps::kColocated).
constexpr int kServersColocated = -1;

struct Options {
  // What to train on.
  std::string model;          // scripted model (.pt), e.g. build/torchscript_models/lenet.pt
  std::string data;           // idx directory or torch.save file; empty: generate a set
  std::string data_cache;     // where generated idx files are written (per host)
  int64_t train_samples = 0;  // documents to generate (token models); images are always 60k/10k

  // How long, how fast.
  std::string mode = "sync";
  int64_t epochs = 1;
  int64_t steps = 0;        // > 0: stop after this many steps (overrides epochs)
  int64_t batch_size = 64;  // per rank
  // > 0: samples per step over all ranks (each takes global_batch / world);
  // the global batches are then the same at any world size (shard_indices).
  int64_t global_batch = 0;
  std::string optimizer = "sgd";
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 0.0;
  double clip_grad_norm = 0.0;  // 0: off (GradSyncOptions::clip_grad_norm, or clip_grad_norm_)
  std::string lr_schedule = "constant";  // constant | cosine | step
  int64_t warmup_steps = 0;
  uint64_t seed = 1;
  int threads = 0;             // intra-op threads; 0: cores / local ranks
  std::string device = "cpu";  // cpu | cuda (each rank its local GPU)
  std::string amp = "off";     // off | bf16 | fp16 (autocast around forward and loss;
                               // fp16 with loss scaling)
  // GradSyncOptions::mixed_precision: parameters in param_dtype with float32
  // masters (fp16: with loss scaling); gradients summed in reduce_dtype.
  std::string param_dtype = "fp32";   // fp32 | bf16 | fp16
  std::string reduce_dtype = "fp32";  // fp32 | bf16 | fp16
  bool cudnn_benchmark = false;  // torch.backends.cudnn.benchmark: cuDNN's algorithms and
                                // tiled_conv2d's path measured per shape (CUDA)

  // GradSync.
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  std::string codec = "none";
  std::string unused = "predict";  // off | predict | exact
  int channels = 1;
  int calls_in_flight = 2;  // GradSyncOptions::calls_in_flight
  std::string overlap = "none";  // none | optimizer | next-forward (GradSyncOptions::overlap)
  std::string shard = "none";    // none | optimizer | gradients (GradSyncOptions::shard)
  int staleness = 0;             // 1: each update one step late (implies --overlap optimizer)
  int stale_warmup = 10;         // synchronous steps before the stale ones
  bool stale_lookahead = true;   // the next forward one local step ahead
  double timeout_s = 0;          // 0: DDPX_TIMEOUT_S, else torch's default
  // A lost rank (mpirun): abort the job, or shrink (the survivors agree and
  // go on in place; needs --global-batch and mpirun's recovery mode).
  std::string on_rank_loss = "abort";
  int min_ranks = 1;  // shrink: fewer survivors than this end the job

  // Parameter server (--mode ps; --codec compresses the pushes).
  int servers = 1;                         // the first K ranks serve, or kServersColocated
  std::string consistency = "async";       // async | ssp:<S> | sync[:<n>]
  std::string ps_pull = "after-push";      // after-push | prefetch | inconsistent
  std::string ps_pull_codec = "none";      // pulls as encoded deltas (ps::Options::pull_codec)
  bool ps_deterministic = false;           // async: fixed application order
  bool ps_staleness_lr = false;            // lr / staleness for stale gradients
  double ps_delay_comp = 0;                // DC-ASGD's lambda (ps::Options::delay_comp); 0: off
  std::string ps_async_momentum = "auto";  // auto | as-given (see trainer_ps.cpp)

  // Layer dropping (layer_drop.h): models with a block_scale attribute.
  std::string layer_drop = "none";  // none | constant:P | stochastic-depth:P | pld:THETA
  double pld_gamma = 0.001;
  std::string layer_drop_pattern = "shared";  // shared | per-rank
  std::string layer_drop_scale = "inverse";   // inverse | none

  // Output.
  std::string checkpoint;        // path; written atomically
  int64_t checkpoint_every = 0;  // steps; 0: only at the end
  bool resume = false;           // continue from --checkpoint if it exists
  std::string trace;             // Chrome trace of GradSync (as DDPX_TRACE)
  std::string trace_steps;       // "a:b" window (as DDPX_TRACE_STEPS)
  std::string metrics;           // JSON lines, rank 0
  std::string status_file;       // the job's outcome (status.h)
  int64_t log_every = 50;
  bool quiet = false;

  // Benchmarks: an emulated slow rank (--straggler RANK:MS).
  int straggler_rank = -1;  // -1: none
  double straggler_ms = 0;  // slept by that rank in each step, before backward
};

// Parses argv; on --help or a usage error prints and exits (CLI11's codes).
Options parse_options(int argc, char** argv);

// " (autocast fp16, loss scaling, ...)": the modes of a run for its header
// line (`scaled`: with loss scaling); "" when none.
std::string describe_modes(const Options& o, bool scaled);

}  // namespace ddpx::trainer
