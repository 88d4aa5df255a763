#include "plugin/trainer/options.h"

#include <c10/util/StringUtil.h>
#include <ddpx/codec.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace ddpx::trainer {

namespace {

// Whether --codec has a sharded form; a bad spec passes here and is
// GradSync's to report, with the codecs' grammar.
bool codec_has_scatter(const std::string& spec) {
  try {
    return comm::make_codec(spec)->has_scatter();
  } catch (const c10::Error&) {
    return true;
  }
}

}  // namespace

Options parse_options(int argc, char** argv) {
  Options o;
  CLI::App app{
      "ddpx-train: train a TorchScript model data-parallel with ddpx::GradSync.\n"
      "Launch with mpirun (ddpx_mpi) or torchrun (Gloo); one process is fine too.\n"
      "  mpirun -np 2 ddpx-train --model build/torchscript_models/lenet.pt --steps 300"};
  app.get_formatter()->column_width(34);

  auto* data = app.add_option_group("model and data");
  data->add_option("--model", o.model, "scripted model file (.pt) with forward(x) -> logits")
      ->required();
  data->add_option("--data", o.data,
                   "an idx directory (train-images-idx3-ubyte, ... of any count and size) or a "
                   "torch.save file of {train_x, train_y, test_x, test_y}; default: a generated "
                   "10-class image set, or generated documents for token models")
      ->check(CLI::ExistingPath);
  data->add_option("--data-cache", o.data_cache,
                   "where the generated image set is written (default: $TMPDIR/ddpx-data-<seed>)");
  data->add_option("--train-samples", o.train_samples,
                   "generated documents for token models (default 20000)")
      ->check(CLI::NonNegativeNumber);

  auto* run = app.add_option_group("schedule");
  run->add_option("--mode", o.mode,
                  "sync: synchronous data parallel; ps: parameter server (the first --servers "
                  "ranks serve, the others work; --servers colocated: every rank does both)")
      ->check(CLI::IsMember({"sync", "ps"}))
      ->capture_default_str();
  run->add_option("--epochs", o.epochs, "epochs over the training set")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  run->add_option("--steps", o.steps, "stop after this many steps (overrides --epochs)")
      ->check(CLI::NonNegativeNumber);
  auto* per_rank_batch = run->add_option("--batch-size", o.batch_size, "samples per rank per step")
                             ->check(CLI::PositiveNumber)
                             ->capture_default_str();
  run->add_option("--global-batch", o.global_batch,
                  "samples per step over all ranks instead (divisible by the world size): the "
                  "same global batches, in the same order, at any world size")
      ->check(CLI::PositiveNumber)
      ->excludes(per_rank_batch);
  run->add_option("--optimizer", o.optimizer, "sgd (with momentum) or adam")
      ->check(CLI::IsMember({"sgd", "adam"}))
      ->capture_default_str();
  run->add_option("--lr", o.lr, "peak learning rate")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  run->add_option("--momentum", o.momentum, "SGD momentum")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  run->add_option("--weight-decay", o.weight_decay)->check(CLI::NonNegativeNumber);
  run->add_option("--clip-grad-norm", o.clip_grad_norm,
                  "clip the averaged gradients' global norm to this before each step, as "
                  "torch.nn.utils.clip_grad_norm_ (sharded: over every rank's parts); 0: off")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  run->add_option("--lr-schedule", o.lr_schedule, "constant | cosine | step (x0.1 at 50% and 75%)")
      ->check(CLI::IsMember({"constant", "cosine", "step"}))
      ->capture_default_str();
  run->add_option("--warmup-steps", o.warmup_steps, "linear warm-up steps")
      ->check(CLI::NonNegativeNumber);
  run->add_option("--seed", o.seed, "initialisation, data generation and shuffling")
      ->capture_default_str();
  run->add_option("--threads", o.threads, "intra-op threads per rank (default: cores / ranks)")
      ->check(CLI::NonNegativeNumber);
  run->add_option("--device", o.device,
                  "cpu, or cuda: each rank trains on its host's GPU number (local rank mod GPUs), "
                  "the launcher's local rank (OMPI_COMM_WORLD_LOCAL_RANK, LOCAL_RANK)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  run->add_option("--amp", o.amp,
                  "off; bf16 or fp16: forward and loss under autocast to that dtype (CPU or "
                  "CUDA; parameters, gradients and the optimizer stay float32); fp16 adds loss "
                  "scaling (ddpx::GradScaler): a step whose gradients overflow is skipped on "
                  "every rank and the scale backs off")
      ->check(CLI::IsMember({"off", "bf16", "fp16"}))
      ->capture_default_str();
  run->add_option("--param-dtype", o.param_dtype,
                  "fp32; bf16 or fp16: the parameters, and so forward and backward, in that "
                  "dtype, GradSync stepping float32 master copies with the optimizer "
                  "(GradSyncOptions::mixed_precision); fp16 adds loss scaling as --amp fp16")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  run->add_option("--reduce-dtype", o.reduce_dtype,
                  "the dtype gradients are summed in across ranks: fp32, bf16 or fp16 (compare "
                  "--codec bf16: bf16 on the wire, summed in fp32 with error feedback)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  run->add_flag("--cudnn-benchmark", o.cudnn_benchmark,
                "measure per shape, on the first steps, cuDNN's algorithms and whether cuDNN or "
                "ddpx's kernels serve each tiled_conv2d pass, as torch.backends.cudnn.benchmark "
                "(faster steps after the first; runs may differ in the last bits; --device cuda)");

  auto* sync = app.add_option_group("GradSync");
  sync->add_option("--bucket-cap-mb", o.bucket_cap_mb)
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sync->add_option("--first-bucket-mb", o.first_bucket_mb)
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sync->add_option("--codec", o.codec, "none | fp16 | bf16 | int8 | topk:<ratio> | powersgd:<rank>")
      ->capture_default_str();
  sync->add_option("--unused", o.unused, "off | predict | exact")
      ->check(CLI::IsMember({"off", "predict", "exact"}))
      ->capture_default_str();
  sync->add_option("--overlap", o.overlap,
                   "none: the optimizer steps after backward; optimizer: GradSync steps it bucket "
                   "by bucket as averages land; next-forward: backward returns once gradients "
                   "are in buckets and the next forward waits per parameter for its update "
                   "(both bit for bit equal to none)")
      ->check(CLI::IsMember({"none", "optimizer", "next-forward"}))
      ->capture_default_str();
  sync->add_option("--shard", o.shard,
                   "ZeRO: optimizer (ZeRO-1): each rank keeps the optimizer state of its 1/W of "
                   "the parameters; gradients (ZeRO-2): and gradient memory for its part only "
                   "(bit for bit equal to none; --codec none)")
      ->check(CLI::IsMember({"none", "optimizer", "gradients"}))
      ->capture_default_str();
  sync->add_option("--staleness", o.staleness,
                   "1: each step's gradients are averaged during the next step and applied at "
                   "the end of its backward (inexact: one step stale; implies --overlap "
                   "optimizer); 0: exact")
      ->check(CLI::Range(0, 1))
      ->capture_default_str();
  sync->add_option("--stale-warmup", o.stale_warmup, "with --staleness 1: synchronous steps first")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  sync->add_option("--stale-lookahead", o.stale_lookahead,
                   "with --staleness 1: each rank runs the next forward one optimizer step "
                   "ahead on its own gradients, replaced by the average's update a step later "
                   "(keeps momentum stable); off: each average applied exactly one step late")
      ->capture_default_str();
  sync->add_option("--channels", o.channels, "process groups used round-robin for buckets")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  sync->add_option("--calls-in-flight", o.calls_in_flight,
                   "buckets on the wire at once per process group (GradSyncOptions::"
                   "calls_in_flight; 1: one at a time)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sync->add_option("--timeout-s", o.timeout_s,
                   "collective timeout (default: DDPX_TIMEOUT_S, else 30 min)")
      ->check(CLI::NonNegativeNumber);
  sync->add_option("--on-rank-loss", o.on_rank_loss,
                   "when a rank dies or freezes (found by the timeout): abort the job, or shrink: "
                   "the survivors agree on who is left, redo the step at the smaller size and go "
                   "on (mpirun with --mca orte_enable_recovery 1, as ddpx-run runs it; needs "
                   "--global-batch and --overlap none)")
      ->check(CLI::IsMember({"abort", "shrink"}))
      ->capture_default_str();
  sync->add_option("--min-ranks", o.min_ranks,
                   "with --on-rank-loss shrink: fewer ranks left than this end the job")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();

  auto* drop = app.add_option_group("layer dropping (models with blocks, e.g. transformer.pt)");
  drop->add_option("--layer-drop", o.layer_drop,
                   "none | constant:P (LayerDrop) | stochastic-depth:P (P at the last block, "
                   "linear in depth) | pld:THETA (Progressive Layer Dropping to keep "
                   "probability THETA)")
      ->capture_default_str();
  drop->add_option("--pld-gamma", o.pld_gamma, "pld: theta(t) = (1 - THETA) exp(-gamma t) + THETA")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  drop->add_option("--layer-drop-pattern", o.layer_drop_pattern,
                   "shared: one pattern on every rank from (seed, step, block), its blocks kept "
                   "off the wire; per-rank: each rank draws its own (LayerDrop's semantics, "
                   "zeros averaged)")
      ->check(CLI::IsMember({"shared", "per-rank"}))
      ->capture_default_str();
  drop->add_option("--layer-drop-scale", o.layer_drop_scale,
                   "inverse: a kept block's residual branches are scaled by 1/keep-probability; "
                   "none: not scaled")
      ->check(CLI::IsMember({"inverse", "none"}))
      ->capture_default_str();

  auto* ps = app.add_option_group("parameter server (--mode ps)");
  ps->add_option("--servers", o.servers,
                 "K: server ranks (the first K), the others are workers; colocated: every rank "
                 "trains and serves 1/world of the parameters")
      ->transform(CLI::Transformer(std::map<std::string, int>{{"colocated", kServersColocated}}))
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            char* end = nullptr;
            const long k = std::strtol(v.c_str(), &end, 10);
            const bool ok = end && *end == '\0' && (k >= 1 || k == kServersColocated);
            return ok ? "" : "must be a number of server ranks >= 1 or 'colocated'";
          },
          "K|colocated"))
      ->capture_default_str();
  ps->add_option("--consistency", o.consistency,
                 "async | ssp:<S> (a worker at most S steps ahead of the slowest) | sync[:<n>] (n "
                 "gradients per "
                 "update, default all workers)")
      ->capture_default_str();
  ps->add_option("--ps-pull", o.ps_pull,
                 "after-push: parameters that include the worker's own last push; prefetch: "
                 "fetched while the step computes; inconsistent: never waits, each server's "
                 "shard goes in when it comes (both async only)")
      ->check(CLI::IsMember({"after-push", "prefetch", "inconsistent"}))
      ->capture_default_str();
  ps->add_option("--ps-pull-codec", o.ps_pull_codec,
                 "none: pulls carry float32 values; fp16 | bf16 | int8[:<chunk>] | topk:<ratio>: "
                 "the difference to what the worker holds, encoded (error feedback: what a pull "
                 "leaves out goes with the next)")
      ->capture_default_str();
  ps->add_flag("--ps-deterministic", o.ps_deterministic,
               "async: apply pushes in a fixed round-robin order (for tests)");
  ps->add_flag("--ps-staleness-lr", o.ps_staleness_lr,
               "a gradient applied tau > 1 versions stale gets lr / tau");
  ps->add_option("--ps-delay-comp", o.ps_delay_comp,
                 "DC-ASGD's lambda: a gradient g computed on w_base is applied as g + lambda * g * "
                 "g * (w_now - w_base); workers send g * g * w_base (4 more bytes per element); "
                 "0: off; not with sync")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  ps->add_option("--ps-async-momentum", o.ps_async_momentum,
                 "auto: under async and ssp with N workers the server's SGD momentum is "
                 "--momentum - (1 - 1/N), as asynchrony itself adds about 1 - 1/N (Mitliagkas "
                 "et al. 2016); as-given: --momentum unchanged")
      ->check(CLI::IsMember({"auto", "as-given"}))
      ->capture_default_str();

  auto* out = app.add_option_group("output");
  out->add_option("--checkpoint", o.checkpoint, "checkpoint file (written atomically by rank 0)");
  out->add_option("--checkpoint-every", o.checkpoint_every,
                  "steps between checkpoints (0: end only)")
      ->check(CLI::NonNegativeNumber);
  out->add_flag("--resume", o.resume, "continue from --checkpoint when it exists");
  out->add_option("--status-file", o.status_file,
                  "the job's outcome, one line replaced atomically: running | ok | ok, ranks "
                  "lost: R... | failed: <rank>: <reason> (what ddpx-run tests)");
  out->add_option("--trace", o.trace,
                  "Chrome/Perfetto trace of GradSync, merged over ranks (like DDPX_TRACE)");
  out->add_option("--trace-steps", o.trace_steps,
                  "traced steps a:b, 1-based inclusive (like DDPX_TRACE_STEPS; default 1:20)");
  out->add_option("--metrics", o.metrics, "JSON lines of metrics (rank 0)");
  out->add_option("--log-every", o.log_every, "steps between progress lines")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  out->add_flag("--quiet", o.quiet, "no progress lines");

  auto* bench = app.add_option_group("benchmarking");
  std::string straggler;
  bench
      ->add_option("--straggler", straggler,
                   "RANK:MS: rank RANK sleeps MS milliseconds in every step, before backward "
                   "(an emulated slow worker, as scripts/bench/ps injects)")
      ->check([](const std::string& v) -> std::string {
        int rank = -1;
        double ms = -1;
        char tail = 0;
        if (std::sscanf(v.c_str(), "%d:%lf%c", &rank, &ms, &tail) != 2 || rank < 0 || ms < 0) {
          return "--straggler wants RANK:MS (a rank >= 0 and milliseconds >= 0), got '" + v + "'";
        }
        return "";
      });

  // A flag given twice takes its last value, so wrappers such as
  // scripts/run.sh can set defaults that the user's own flags override.
  for (CLI::Option* opt : app.get_options()) {
    opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  if (!straggler.empty()) {
    std::sscanf(straggler.c_str(), "%d:%lf", &o.straggler_rank, &o.straggler_ms);
  }
  const bool mixed = o.param_dtype != "fp32" || o.reduce_dtype != "fp32";
  if (o.amp != "off" && o.param_dtype != "fp32") {
    std::exit(app.exit(CLI::ValidationError(
        "--amp", "autocasts float32 parameters; with --param-dtype " + o.param_dtype +
                     " the model computes in " + o.param_dtype + " already: choose one")));
  }
  if ((o.amp != "off" || mixed) && o.mode == "ps") {
    std::exit(app.exit(CLI::ValidationError(
        "--amp", "--amp, --param-dtype and --reduce-dtype are GradSync's (--mode sync); the "
                 "parameter server (--mode ps) trains in float32")));
  }
  if ((o.amp == "fp16" || mixed) && o.staleness > 0) {
    std::exit(app.exit(CLI::ValidationError(
        "--staleness", "1 does not combine with --amp fp16 (loss scaling) or --param-dtype / "
                       "--reduce-dtype: choose one")));
  }
  if (o.clip_grad_norm > 0 && (o.staleness > 0 || o.mode == "ps")) {
    std::exit(app.exit(CLI::ValidationError(
        "--clip-grad-norm", o.staleness > 0 ? "does not combine with --staleness 1 (the stale "
                                              "update would go unclipped)"
                                            : "is GradSync's (--mode sync)")));
  }
  if (o.shard != "none") {
    // What GradSyncOptions::shard does not combine with, before any rank starts.
    std::string other;
    if (o.mode == "ps") {
      other = "--mode ps (the parameter server holds the state)";
    } else if (o.codec != "none" && !codec_has_scatter(o.codec)) {
      other = "--codec " + o.codec + " (its compression is over whole tensors, which an "
              "owner's part may cut; none, fp16, bf16 and int8 have sharded forms)";
    } else if (o.staleness > 0) {
      other = "--staleness 1";
    } else if (mixed) {
      other = "--param-dtype / --reduce-dtype";
    } else if (o.amp == "fp16") {
      other = "--amp fp16 (loss scaling)";
    } else if (o.on_rank_loss == "shrink" && o.checkpoint.empty()) {
      other = "--on-rank-loss shrink without --checkpoint (a lost rank's shard of the optimizer "
              "state is reloaded from the last checkpoint)";
    }
    if (!other.empty()) {
      std::exit(
          app.exit(CLI::ValidationError("--shard", o.shard + " does not combine with " + other)));
    }
  }
  if (o.param_dtype != "fp32" && o.on_rank_loss == "shrink") {
    std::exit(app.exit(CLI::ValidationError(
        "--on-rank-loss", "shrink redoes a failed step, which --param-dtype (GradSync stepping "
                          "float32 masters) cannot: choose one")));
  }
  if (o.cudnn_benchmark && o.device != "cuda") {
    std::exit(app.exit(CLI::ValidationError("--cudnn-benchmark", "cuDNN needs --device cuda")));
  }
  if (o.device != "cpu" && o.mode == "ps") {
    std::exit(app.exit(CLI::ValidationError(
        "--device",
        "the parameter server (--mode ps) trains on the CPU only; drop --device cuda")));
  }
  if (o.resume && o.checkpoint.empty()) {
    std::exit(app.exit(CLI::ValidationError("--resume", "needs --checkpoint PATH")));
  }
  return o;
}

// " (autocast fp16, loss scaling, cudnn benchmark)" for the header line; ""
// when none of them.
std::string describe_modes(const Options& o, bool scaled) {
  std::vector<std::string> on;
  if (o.amp != "off") on.push_back("autocast " + o.amp);
  if (o.param_dtype != "fp32") on.push_back(o.param_dtype + " parameters, fp32 masters");
  if (o.param_dtype != "fp32" || o.reduce_dtype != "fp32") {
    on.push_back("reduced in " + o.reduce_dtype);
  }
  if (scaled) on.push_back("loss scaling");
  if (o.shard == "optimizer") on.push_back("ZeRO-1: optimizer state sharded");
  if (o.shard == "gradients") on.push_back("ZeRO-2: optimizer state and gradients sharded");
  if (o.clip_grad_norm > 0) on.push_back("gradient norm clipped to " + c10::str(o.clip_grad_norm));
  if (o.cudnn_benchmark) on.push_back("cudnn benchmark");
  return on.empty() ? "" : " (" + c10::Join(", ", on) + ")";
}

}  // namespace ddpx::trainer
