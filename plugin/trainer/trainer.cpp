#include "plugin/trainer/trainer.h"

#include <ATen/Context.h>
#include <c10/util/StringUtil.h>
#include <ddpx/amp.h>
#include <ddpx/comm.h>
#include <ddpx/grad_sync.h>
#include <ddpx/layer_drop.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/utils.h>  // torch::manual_seed

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <thread>

#include "plugin/trainer/checkpoint.h"
#include "plugin/trainer/data.h"
#include "plugin/trainer/hang_report.h"
#include "plugin/trainer/model.h"
#include "plugin/trainer/optim.h"
#include "plugin/trainer/run_common.h"
#include "plugin/trainer/shrink.h"

namespace ddpx::trainer {
namespace {

using Clock = std::chrono::steady_clock;

Unused parse_unused(const std::string& s) {
  if (s == "off") return Unused::Off;
  if (s == "exact") return Unused::Exact;
  TORCH_CHECK(s == "predict", "ddpx-train: --unused must be off, predict or exact, got '", s, "'");
  return Unused::Predict;
}

// The blocks --layer-drop drops: the model's `block_scale` (a list of floats,
// one per block, as torchscript_models/transformer.py has), whose block i
// holds the parameters "blocks.<i>.*". Returns their prefixes.
std::vector<std::string> drop_units(const torch::jit::Module& m, const std::string& path) {
  TORCH_CHECK(m.hasattr("block_scale") && m.attr("block_scale").isDoubleList(),
              "ddpx-train: --layer-drop needs a model with blocks to drop (a List[float] "
              "attribute 'block_scale', e.g. transformer.pt); ",
              path, " has none");
  const auto depth = m.attr("block_scale").toDoubleList().size();
  std::vector<std::string> units;
  for (size_t i = 0; i < depth; ++i) {
    units.push_back("blocks." + std::to_string(i) + ".");
    bool any = false;
    for (const auto& p : m.named_parameters()) any = any || p.name.rfind(units.back(), 0) == 0;
    TORCH_CHECK(any, "ddpx-train: model ", path, " has ", depth,
                " entries in block_scale but no "
                "parameters named ",
                units.back(), "*");
  }
  return units;
}

void set_block_scale(torch::jit::Module& m, const std::vector<double>& scales) {
  m.setattr("block_scale", c10::List<double>(c10::ArrayRef<double>(scales)));
}

// --amp, --param-dtype, --reduce-dtype: "fp32" | "bf16" | "fp16".
at::ScalarType dtype_of(const std::string& s) {
  return s == "bf16" ? at::kBFloat16 : s == "fp16" ? at::kHalf : at::kFloat;
}

}  // namespace

std::string run(const Options& o) {
  if (o.mode == "ps") return run_ps(o);
  const auto timeout = o.timeout_s > 0
                           ? std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000))
                           : comm::default_timeout();
  // The GPU first: NCCL binds each rank to the current device.
  const at::Device device = select_device(o);
  // (Read on every convolution: ATen's cuDNN calls and our ops' path choice,
  // kernels/common/conv_path_tuner.h.)
  if (o.cudnn_benchmark) at::globalContext().setBenchmarkCuDNN(true);
  auto pg = comm::init_from_env(timeout);
  int rank = pg->getRank(), world = pg->getSize();
  bool lead = rank == 0;
  arm_hang_report(*pg, timeout);
  check_shrink_options(o, world);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(o.threads > 0 ? o.threads : std::max(1, cores / local_ranks()));
  torch::manual_seed(o.seed);

  ScriptedModel sm = load_model(o.model);
  torch::jit::Module& model = sm.module;
  move_model(model, device);
  model.train();
  const LayerDrop drop =
      parse_layer_drop(o.layer_drop, o.pld_gamma, o.layer_drop_pattern, o.layer_drop_scale, o.seed);
  const std::vector<std::string> units =
      drop.active() ? drop_units(model, o.model) : std::vector<std::string>{};
  const int depth = static_cast<int>(units.size());
  TORCH_CHECK(!drop.per_rank || !drop.active() || o.unused != "off",
              "ddpx-train: --layer-drop-pattern per-rank leaves blocks unused on some ranks; it "
              "needs --unused predict or exact");
  const DataSplit data = load_data(o, sm);
  const int64_t per_rank = data.train.size() / world;
  TORCH_CHECK(o.global_batch == 0 || o.global_batch % world == 0, "ddpx-train: --global-batch ",
              o.global_batch, " is not divisible by the world size ", world);
  // Samples per rank per step. (shard_indices deals the epoch's permutation
  // round-robin, so a step's global batch is the same at any world size.)
  const bool global = o.global_batch > 0;
  int64_t batch = global ? o.global_batch / world : o.batch_size;
  const int64_t steps_per_epoch = per_rank / batch;
  TORCH_CHECK(steps_per_epoch > 0, "ddpx-train: ", global ? "--global-batch " : "--batch-size ",
              global ? o.global_batch : o.batch_size, " takes ", batch * world,
              " samples a step over ", world, " ranks, more than the ", data.train.size(),
              " training samples");
  const int64_t total = o.steps > 0 ? o.steps : o.epochs * steps_per_epoch;

  std::vector<at::Tensor> params;
  for (const auto& p : model.parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  auto opt = make_optimizer(params, o);
  const at::ScalarType param_dtype = dtype_of(o.param_dtype);
  // Loss scaling wherever gradients are float16 (ddpx/amp.h).
  std::unique_ptr<GradScaler> scaler;
  if (o.amp == "fp16" || param_dtype == at::kHalf) scaler = std::make_unique<GradScaler>();
  GradSyncOptions so;
  if (o.param_dtype != "fp32" || o.reduce_dtype != "fp32") {
    so.mixed_precision(param_dtype, dtype_of(o.reduce_dtype));
  }
  so.trace(o.trace).trace_steps(o.trace_steps);
  so.bucket_cap_mb(o.bucket_cap_mb)
      .first_bucket_mb(o.first_bucket_mb)
      .calls_in_flight(o.calls_in_flight)
      .codec(o.codec)
      .unused(parse_unused(o.unused))
      .overlap(o.overlap == "optimizer" || (o.overlap == "none" && o.staleness > 0)
                   ? Overlap::Optimizer
               : o.overlap == "next-forward" ? Overlap::NextForward
                                             : Overlap::None)
      .shard(o.shard == "optimizer"   ? Shard::Optimizer
             : o.shard == "gradients" ? Shard::Gradients
                                      : Shard::None)
      .staleness(o.staleness)
      .stale_warmup(o.stale_warmup)
      .stale_lookahead(o.stale_lookahead);
  // (Float32 masters of low-precision parameters: only GradSync steps them.)
  // (Sharded: each rank holds the average of its own part only.)
  const bool stepped_by_sync =
      so.overlap_ != Overlap::None || param_dtype != at::kFloat || so.shard_ != Shard::None;
  so.clip_grad_norm(stepped_by_sync ? o.clip_grad_norm : 0.0);  // (else: below, before step())
  // A shared pattern is declared to GradSync each step: each block gets
  // buckets of its own, which a dropped block skips whole.
  if (drop.active() && !drop.per_rank) so.drop_units(units);
  // (the channels: what init_from_env made; torchrun with CUDA: NCCL for CUDA tensors)
  const std::string backend = comm::detect_launcher() == comm::Launcher::Mpi ? "ddpx_mpi"
                              : device.is_cuda()                             ? "cpu:gloo,cuda:nccl"
                                                                             : "gloo";
  for (int c = 1; c < o.channels; ++c) {
    comm::MakeOptions mo;
    mo.timeout = timeout;
    mo.name = "channel" + std::to_string(c);
    so.channels.push_back(comm::make(backend, mo));
  }
  // (next-forward: gates the model's reads of its parameters)
  auto sync = std::make_unique<GradSync>(model, pg, so);
  if (device.is_cuda() && param_dtype != at::kFloat) flatten_gru_weights(model);
  const auto give_optimizer = [&] {
    if (!stepped_by_sync) return;
    if (scaler) {
      sync->set_optimizer(*opt, *scaler);
    } else {
      sync->set_optimizer(*opt);
    }
  };
  give_optimizer();

  std::optional<TrainObjects> objs;
  const auto make_objs = [&] {
    objs.emplace(TrainObjects{model, *opt, o.optimizer, *sync, drop.describe(), device, rank, world,
                              batch * world, scaler.get(), so.shard_ != Shard::None});
  };
  make_objs();
  Position pos;
  // Restarted by torchrun (elastic): the checkpoint is where to go on from,
  // at whatever world size the restart has, with no --resume to add.
  const int restart = elastic_restart();
  if (!o.checkpoint.empty()) {
    if (o.resume || restart > 0) {
      if (lead && restart > 0) {
        std::cout << "[ddpx-train] torchrun restart " << restart << " with " << world
                  << " rank(s): resuming from " << o.checkpoint << std::endl;
      }
      const bool resumed = load_checkpoint(o.checkpoint, *pg, *objs, pos);
      if (lead) {
        std::cout << (resumed ? "[ddpx-train] resumed from " : "[ddpx-train] no checkpoint at ")
                  << o.checkpoint
                  << (resumed ? " at step " + std::to_string(pos.step) : ": starting at step 0")
                  << std::endl;
      }
    } else {
      refuse_to_overwrite(o, *pg);
    }
  }
  std::ofstream metrics;
  if (lead && !o.metrics.empty()) {
    metrics.open(o.metrics, pos.step > 0 ? std::ios::app : std::ios::trunc);
    TORCH_CHECK(metrics, "ddpx-train: cannot write --metrics ", o.metrics);
  }
  if (lead && !o.quiet) {
    std::cout << "[ddpx-train] " << o.model << ": " << params.size() << " parameter tensors, "
              << world << " rank(s) over " << (world > 1 ? backend : "one process") << " on "
              << (device.is_cuda() ? "cuda" : "cpu") << describe_modes(o, scaler != nullptr) << ", "
              << total << " steps of " << batch << " x " << world << " samples, codec " << o.codec
              << std::endl;
    if (drop.active()) {
      std::cout << "[ddpx-train] layer drop: " << drop.describe() << " over " << depth << " blocks"
                << std::endl;
    }
  }

  const auto t_start = Clock::now();
  auto t_window = t_start;
  const int64_t first_step = pos.step;
  // Loss and correct predictions summed on the device (no host sync per step).
  const auto zero_stats = [&] { return at::zeros({2}, at::dtype(at::kDouble).device(device)); };
  at::Tensor w_stats = zero_stats();
  double w_count = 0, last_loss = 0, last_acc = 0;
  int64_t skipped_here = 0;  // steps the scaler skipped, when the trainer steps
  double w_kept = 0, w_steps = 0, last_kept = 1;
  at::Tensor idx;
  int64_t idx_epoch = -1;
  // One step (a lambda: --on-rank-loss shrink redoes a failed one).
  const auto train_step = [&] {
    if (pos.batch >= steps_per_epoch) {
      ++pos.epoch;
      pos.batch = 0;
    }
    if (idx_epoch != pos.epoch) {
      idx = shard_indices(data.train.size(), rank, world, pos.epoch, o.seed);
      idx_epoch = pos.epoch;
    }
    injected_stall(pos.step + 1, rank);
    const at::Tensor rows = idx.narrow(0, pos.batch * batch, batch);
    log_samples(pos.step, rank, world, rows);
    at::Tensor x = rows_to(data.train.inputs, rows, device);
    // (Parameters in a low dtype: floating inputs too, as FSDP casts them.)
    if (param_dtype != at::kFloat && x.is_floating_point()) x = x.to(param_dtype);
    const at::Tensor y = rows_to(data.train.targets, rows, device);
    set_lr(*opt, lr_at(pos.step, total, o));  // (GradSync takes it when backward begins)
    if (!stepped_by_sync) opt->zero_grad();   // (else each update consumes its gradients)
    if (drop.active()) {
      const std::vector<double> scales = drop.scales(pos.step, depth, rank);
      set_block_scale(model, scales);
      std::vector<std::string> dropped;
      for (int b = 0; b < depth; ++b) {
        if (scales[b] == 0) dropped.push_back(units[b]);
      }
      if (!drop.per_rank) sync->declare_unused(dropped);
      w_kept += 1.0 - static_cast<double>(dropped.size()) / depth;
    }
    w_steps += 1;
    at::Tensor logits, loss;
    {
      // --amp: ops under ATen's autocast policy (matmuls and convolutions in
      // the low dtype, the loss in float32), as Python's torch.autocast.
      std::optional<Autocast> amp;
      if (o.amp != "off") amp.emplace(device.type(), dtype_of(o.amp));
      logits = model.forward({x}).toTensor();
      loss = torch::nn::functional::cross_entropy(logits.to(at::kFloat), y);
    }
    straggle(o, rank);
    if (so.unused_ == Unused::Exact) sync->prepare_for_backward({loss});
    (scaler ? scaler->scale(loss) : loss).backward();
    if (!stepped_by_sync) {
      auto in_trace = sync->phase("optimizer_step");
      if (scaler && o.clip_grad_norm > 0) scaler->unscale_(*opt);  // (clip the true gradients)
      if (o.clip_grad_norm > 0) torch::nn::utils::clip_grad_norm_(params, o.clip_grad_norm);
      if (scaler) {
        skipped_here += scaler->step(*opt) ? 0 : 1;
        scaler->update();
      } else {
        opt->step();
      }
    }
    ++pos.step;
    ++pos.batch;
    w_stats += at::stack({loss.detach().to(at::kDouble) * double(batch),
                          logits.argmax(1).eq(y).sum().to(at::kDouble)});
    w_count += double(batch);

    const bool log_now = pos.step % o.log_every == 0 || pos.step == total;
    // Next-forward and stale: the step's collectives may still be running on
    // pg, and a checkpoint must hold the updated parameters and state (stale:
    // the pending update lands here, a step early).
    const bool save_now = o.checkpoint_every > 0 && pos.step % o.checkpoint_every == 0;
    if (log_now || save_now || pos.step == total) sync->synchronize();
    if (log_now) {
      auto w = allreduce_sum(*pg, at::cat({w_stats.cpu(), at::tensor({w_count}, at::kDouble)}));
      const auto now = Clock::now();
      const double dt = std::chrono::duration<double>(now - t_window).count();
      const double elapsed = std::chrono::duration<double>(now - t_start).count();
      const double rate = w[2].item<double>() / std::max(dt, 1e-9);
      last_loss = w[0].item<double>() / w[2].item<double>();
      last_acc = w[1].item<double>() / w[2].item<double>();
      last_kept = drop.active() ? w_kept / std::max(w_steps, 1.0) : 1.0;  // rank 0's blocks
      const double per_step = elapsed / double(pos.step - first_step);
      // Loss scaling: the scale now, and the steps skipped so far (this run).
      const double scale = scaler ? scaler->get_scale() : 1.0;
      const int64_t skipped = stepped_by_sync ? sync->last_step().skipped_steps : skipped_here;
      if (lead && !o.quiet) {
        char line[256];
        std::snprintf(line, sizeof line,
                      "[ddpx-train] step %lld/%lld  epoch %lld  loss %.4f  acc %5.1f%%  "
                      "%.0f samples/s  ETA %s",
                      (long long)pos.step, (long long)total, (long long)pos.epoch, last_loss,
                      100 * last_acc, rate, eta(per_step * double(total - pos.step)).c_str());
        char kept[32] = "";
        if (drop.active()) std::snprintf(kept, sizeof kept, "  kept %.2f", last_kept);
        char amp_text[64] = "";
        if (scaler) {
          std::snprintf(amp_text, sizeof amp_text, "  scale %g  skipped %lld", scale,
                        (long long)skipped);
        }
        std::cout << line << kept << amp_text << std::endl;
      }
      if (metrics.is_open()) {
        const auto& st = sync->last_step();
        metrics << nlohmann::json{{"step", pos.step},
                                  {"epoch", pos.epoch},
                                  {"loss", last_loss},
                                  {"accuracy", last_acc},
                                  {"samples_per_s", rate},
                                  {"lr", lr_at(pos.step - 1, total, o)},
                                  {"elapsed_s", elapsed},
                                  {"backward_us", st.backward_us},
                                  {"exposed_comm_us", st.exposed_comm_us},
                                  {"gate_wait_us", st.gate_wait_us},
                                  {"hook_cpu_us", st.hook_cpu_us},
                                  {"replans", st.replans},
                                  {"bytes_reduced", st.bytes_reduced},
                                  {"kept_fraction", last_kept},
                                  {"amp_scale", scale},
                                  {"skipped_steps", skipped}}
                       .dump()
                << std::endl;
      }
      t_window = now;
      w_stats = zero_stats();
      w_count = w_kept = w_steps = 0;
    }
    if (!o.checkpoint.empty() && (save_now || pos.step == total)) {
      save_checkpoint(o.checkpoint, *pg, *objs, pos);
    }
    injected_failure(pos.step, rank);
  };
  // --on-rank-loss shrink: the world ranks still in the job.
  std::vector<int> members(world);
  std::iota(members.begin(), members.end(), 0);
  std::vector<comm::ProcessGroupPtr> retired;  // the old groups: never called again, never freed
  const Procs procs = o.on_rank_loss == "shrink" ? gather_procs(*pg) : Procs{};
  std::vector<int> lost_all;
  const auto shrink_now = [&](const std::string& why) {
    const auto t0 = Clock::now();
    GradSync::State own;  // this rank's codec residuals go on with it
    try {
      own = sync->state();
    } catch (const c10::Error&) {
      // (The failed step left nothing to carry: the new GradSync starts clean.)
    }
    const Shrunk sh = shrink_after_loss(o, why, members, pos.step, timeout, procs);
    retired.push_back(pg);
    sync.reset();  // its collectives on the old group were abandoned
    pg = sh.pg;
    rank = pg->getRank();
    world = pg->getSize();
    lead = rank == 0;
    TORCH_CHECK(o.global_batch % world == 0, "ddpx-train: --global-batch ", o.global_batch,
                " is not divisible by the ", world, " rank(s) left");
    batch = o.global_batch / world;
    sync = std::make_unique<GradSync>(model, pg, so);
    give_optimizer();
    make_objs();
    if (so.shard_ != Shard::None) {
      // The lost ranks' parts of the optimizer state are gone with them:
      // every survivor goes back to the last checkpoint, re-split over the
      // ranks left (the steps since are redone).
      TORCH_CHECK(load_checkpoint(o.checkpoint, *pg, *objs, pos), "ddpx-train: a rank was lost "
                  "before the first checkpoint (", o.checkpoint, "); with --shard its part of the "
                  "optimizer state can only be reloaded from one");
    } else {
      share_state(*pg, sh.leader, *objs, pos);  // the most advanced survivor's step, for all
    }
    if (!own.residuals.empty()) {
      GradSync::State st = sync->state();
      st.residuals = own.residuals;
      sync->load_state(st);
    }
    idx_epoch = -1;  // the same global batches, sliced among `world`
    lost_all.insert(lost_all.end(), sh.lost.begin(), sh.lost.end());
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    if (lead && !o.metrics.empty() && !metrics.is_open()) {  // rank 0 was lost: this one logs
      metrics.open(o.metrics, std::ios::app);
      TORCH_CHECK(metrics, "ddpx-train: cannot write --metrics ", o.metrics);
    }
    if (lead) {
      std::cout << "[ddpx-train] lost rank(s) " << c10::Join(" ", sh.lost) << ": going on with "
                << world << " rank(s) from step " << pos.step << " (" << batch
                << " samples each; agreed in " << sh.agree_s << " s, state shared in "
                << took - sh.agree_s << " s)" << std::endl;
      if (metrics.is_open()) {
        metrics << nlohmann::json{{"event", "shrink"},
                                  {"step", pos.step},
                                  {"lost", sh.lost},
                                  {"world", world},
                                  {"agree_s", sh.agree_s},
                                  {"recover_s", took},
                                  {"unix_time",
                                   std::chrono::duration<double>(
                                       std::chrono::system_clock::now().time_since_epoch())
                                       .count()}}
                       .dump()
                << std::endl;
      }
    }
    w_stats = zero_stats();
    w_count = w_kept = w_steps = 0;
    t_window = Clock::now();
  };
  while (pos.step < total) {
    if (o.on_rank_loss != "shrink") {
      train_step();
      continue;
    }
    try {
      train_step();
    } catch (const c10::Error& e) {
      shrink_now(e.what_without_backtrace());
    }
  }

  // The closing collectives. A rank lost here, after the last step, is
  // survived as in a step: the survivors shrink (one that failed in the last
  // step itself takes the most advanced one's state there) and close over
  // their own group.
  double test_acc = 0;
  for (;;) {
    try {
      sync->flush_trace();  // collective: every rank, before anything can fail alone
      if (drop.active()) set_block_scale(model, std::vector<double>(depth, 1.0));  // every block
      test_acc = evaluate(model, data.test, *pg, 256);
      break;
    } catch (const c10::Error& e) {
      if (o.on_rank_loss != "shrink") throw;
      shrink_now(e.what_without_backtrace());
    }
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
  if (lead) {
    if (!o.quiet) {
      char line[200];
      std::snprintf(line, sizeof line,
                    "[ddpx-train] done: %lld steps in %.1f s, train loss %.4f, train acc %.1f%%, "
                    "test accuracy %.2f%%",
                    (long long)(pos.step - first_step), elapsed, last_loss, 100 * last_acc,
                    100 * test_acc);
      std::cout << line << std::endl;
      std::cout << "[ddpx-train] GradSync profile (rank 0):\n" << sync->profile_summary();
      if (!o.trace.empty()) std::cout << "[ddpx-train] trace: " << o.trace << std::endl;
    }
    if (metrics.is_open()) {
      // What the codec achieved (a codec that compresses nothing shows 1).
      const auto prof = sync->profile();
      metrics << nlohmann::json{{"event", "end"},
                                {"step", pos.step},
                                {"loss", last_loss},
                                {"accuracy", last_acc},
                                {"test_accuracy", test_acc},
                                {"elapsed_s", elapsed},
                                {"bytes_sent_per_step", prof.bytes_sent},
                                {"compression", prof.compression},
                                {"layer_drop", drop.describe()},
                                {"overlap", o.overlap},
                                {"staleness", o.staleness},
                                {"amp", o.amp},
                                {"param_dtype", o.param_dtype},
                                {"reduce_dtype", o.reduce_dtype},
                                {"stale_lookahead", o.staleness > 0 && o.stale_lookahead}}
                     .dump()
              << std::endl;
    }
  }
  if (!lead) return "";
  return lost_all.empty() ? "ok" : "ok, ranks lost: " + c10::Join(" ", lost_all);
}

}  // namespace ddpx::trainer
