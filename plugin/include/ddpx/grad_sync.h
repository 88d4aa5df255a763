#pragma once
// GradSync: DDP-style gradient averaging for C++ trainers (LibTorch has no
// DistributedDataParallel).
//
// A training loop (tests/cpp/test_header_examples.cpp runs this text as it
// stands, with `model` a torch::nn module and x, y this rank's part of the
// batch, and checks it against one process on the whole batch):
// [example grad_sync]
//   auto pg = ddpx::comm::init_from_env();  // mpirun -> ddpx_mpi, torchrun -> Gloo
//   ddpx::GradSync sync(model->named_parameters(), pg,
//                       ddpx::GradSyncOptions().bucket_cap_mb(25).unused(ddpx::Unused::Predict));
//   torch::optim::SGD opt(model->parameters(), 0.1);
//   for (int step = 0; step < 10; ++step) {
//     opt.zero_grad();
//     auto loss = torch::mse_loss(model->forward(x), y);
//     loss.backward();  // gradients are averaged across ranks when backward returns
//     opt.step();
//   }
// [end example]
//
// Protocol, one step (every rank runs the same steps in the same order):
//  1. Construction: parameter (and buffer) counts, shapes and dtypes are
//     compared across ranks (an error names the first differing one and the
//     ranks);
//     rank 0's parameters and buffers are broadcast. Buckets are planned in
//     reverse registration order (the usual backward order).
//  2. Backward: a post-hook on each parameter's gradient accumulator copies
//     the gradient into its bucket (nothing to copy when .grad already is its
//     bucket slot, see gradient_as_bucket_view) and marks it ready. A bucket launches its
//     reduction (codec -> collective, on the bucket's channel thread) once it
//     is complete and every bucket before it has launched, so the launch
//     order is the plan's order on every rank. A parameter whose gradients
//     come sparse (learnt from the step-end agreement) has a bucket of its
//     own: its .grad is referenced, not copied, and its reduction gathers
//     every rank's rows (hooks/sparse_reduce.h). On a device with streams
//     (CUDA) the reduction runs on the channel's stream after events on the
//     streams that wrote the bucket (hooks/stream_handoff.h).
//  3. End of backward (autograd final callback): parameters that never
//     produced a gradient are resolved: Unused::Off -> error naming them;
//     otherwise they contribute zeros (or, if no_sync micro-batches left a
//     .grad since the last synced step, that .grad), the remaining buckets
//     launch, and a used-bitmap MAX-reduction tells which are unused on every
//     rank (their .grad is left untouched, as under DDP). Late buckets --
//     those of parameters that went unused in recent steps -- launch only
//     after that agreement (under Exact: after the one prepare_for_backward
//     makes, so during backward, planned where their gradients arrive; under
//     Predict: planned last), and send only the slots some rank used.
//     All reductions are awaited and
//     the averages written to .grad before backward returns: with
//     gradient_as_bucket_view, .grad is made a view of its bucket slot (the
//     average is already there, and the next backward accumulates straight
//     into the bucket); a locally unused parameter whose .grad is its slot
//     gets a private copy of it before the slot is zeroed. On a device, the
//     caller's current stream (where the optimizer runs) is first made to
//     wait for every reduction. Last, rank 0's buffers are broadcast
//     (broadcast_buffers).
//  4. Between steps: the order predictor learns from this step's arrival
//     order and times and which parameters go unused. Buckets close at a cap
//     and also where the link would otherwise sit idle with gradients ready
//     (for over 2% of backward, at least 1 ms; from the predicted arrival
//     times and the link's measured rate), so ready gradients go out during
//     a pause in backward, or while the rest of an even stream arrives,
//     instead of waiting in a half-full bucket. When the
//     predicted order would launch buckets materially later than a re-plan
//     would, or a model of the link (its rate as measured) says the re-plan's
//     reductions would finish materially earlier, or the set of late
//     parameters has changed, or that of sparse ones, rank 0's proposal is broadcast and every rank
//     adopts the same plan at the step boundary. Re-planning changes
//     timing, never exact results; a lossy codec's error-feedback residuals
//     move with their parameters to the new buckets, so no compression error
//     is lost (PowerSGD's warm start is dropped).
#include <c10/core/ScalarType.h>
#include <ddpx/comm.h>
#include <ddpx/grad_sync_options.h>
#include <torch/ordered_dict.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch::jit {
struct Module;
}
namespace torch::optim {
class Optimizer;
}

namespace ddpx {

class GradScaler;  // ddpx/amp.h

// What one step cost; all times in microseconds from the start of backward.
struct StepStats {
  int64_t step = 0;
  double backward_us = 0;      // first hook -> final callback entry
  double exposed_comm_us = 0;  // final callback entry -> all reductions written back
  double comm_us = 0;  // sum over buckets of launch -> complete, and of their gathers (sharded)
  double hook_cpu_us = 0;      // time spent inside our hooks and final callback
  double per_param_hooks_us = 0;  // of which the per-parameter work of the hooks (the rest,
                                  // the step's start and end, is paid once per step)
  int64_t hook_calls = 0;
  int64_t bytes_reduced = 0;
  int64_t replans = 0;         // total so far
  int64_t unused_mispredictions = 0;
  // Overlap::NextForward: how long the forward before this backward waited
  // at parameter gates for the previous step's updates, and how often.
  double gate_wait_us = 0;
  int64_t gate_waits = 0;
  // Shard::Gradients: how long backward waited for bucket memory (a bucket
  // on the wire to be freed by its reduction), and how often; in
  // backward_us too.
  double memory_wait_us = 0;
  int64_t memory_waits = 0;
  // GradSyncOptions::staleness: this step's update is applied at the end of
  // the next backward (exposed_comm_us is then the end of this backward:
  // the wait for the last step's reductions, its update, the launches).
  bool stale = false;
  // Overlap::NextForward with priority: buckets the plan holds for the end
  // of backward, and whether they went first layer first this step (else
  // first in, first out: a trial step, or priority measured not to pay).
  int64_t held_planned = 0;
  bool priority_on = false;
  // set_optimizer(optimizer, scaler): an average was inf or NaN, so no
  // parameter was stepped (on any rank) and the scale backed off; and the
  // steps so skipped by this GradSync, this one included.
  bool skipped = false;
  int64_t skipped_steps = 0;
  struct Bucket {
    int index;
    int channel;
    double ready_us, launch_us, complete_us;
    int64_t bytes;
    bool held;  // launched by priority at the end of backward (GradSyncOptions::priority)
    // Of `bytes`, those held back by priority: a bucket still on the link at
    // the end of backward sends its remainder after the held buckets, which
    // overtake it (complete_us is then the remainder's).
    int64_t held_bytes;
    // GradSyncOptions::shard: its gather (the owners' updated parts sent to
    // every rank), begun and done, after complete_us; -1: none this step.
    double gather_us = -1, gathered_us = -1;
  };
  std::vector<Bucket> buckets;
};

// Per-step medians over the steps run so far (the last 100000), from
// GradSync::profile(). Times in microseconds.
struct ProfileSummary {
  int64_t steps = 0;
  int64_t params = 0;                  // parameter tensors synced
  double backward_us = 0;              // compute: first hook -> final callback
  double comm_us = 0;                  // wall time with a bucket on the wire (reduction, gather)
  double exposed_comm_us = 0;          // final callback -> gradients written back
  double overlap_efficiency = 0;       // 1 - exposed / comm, per step
  double hook_cpu_us = 0;              // hooks + final callback, CPU
  double hook_cpu_per_param_us = 0;    // the hooks alone / hook calls
  double bytes_sent = 0;               // this rank's bytes on the wire
  double compression = 0;              // float32-equivalent bytes / bytes sent
  int64_t replans = 0;                 // re-planning events in these steps
  int64_t unused_mispredictions = 0;   // summed over these steps
  double gate_wait_us = 0;             // Overlap::NextForward: forward waiting at gates
  double memory_wait_us = 0;           // Shard::Gradients: backward waiting for bucket memory
  // Priority (NextForward): buckets held and launched first layer first (the
  // held part is cut into pieces), and the bytes of a bucket cut at the end
  // of backward that they overtook (StepStats::Bucket::held_bytes).
  double held_buckets = 0;
  double overtaken_bytes = 0;
  // Memory of this rank, bytes, now: the parameters GradSync syncs, the
  // state the optimizer given to set_optimizer keeps for them (0: none
  // given), and the gradient buckets at their most during the last step
  // (GradSyncOptions::shard(Shard::Gradients): only those in use; else all).
  double param_bytes = 0;
  double optimizer_state_bytes = 0;
  double grad_buffer_bytes = 0;
};

class GradSync {
 public:
  GradSync(const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
           comm::ProcessGroupPtr pg, GradSyncOptions options = {},
           const torch::OrderedDict<std::string, at::Tensor>& named_buffers =
               torch::OrderedDict<std::string, at::Tensor>());
  // Parameters and buffers of a scripted model.
  GradSync(const torch::jit::Module& module, comm::ProcessGroupPtr pg,
           GradSyncOptions options = {});
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // Unused::Exact: call before backward with the forward's outputs.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);

  // Layer dropping: the parameters that the next synced backward produces
  // no gradient for on any rank (the blocks a shared drop pattern skips),
  // each a parameter name or a prefix of names (a drop unit). Every rank
  // must declare the same set for the same step, e.g. drawn from (seed,
  // step, block); call it on every rank or on none, between steps (outside
  // no_sync). Their slots stay off the wire, they are neither predicted
  // unused nor re-planned around, and their .grad is left untouched, as for
  // parameters unused on every rank. The ranks compare the declarations in
  // one small collective that overlaps the forward; a mismatch, a declared
  // parameter that still gets a gradient, or one holding a gradient
  // accumulated under no_sync fails the step on every rank with an error
  // naming it. A per-rank pattern must not be declared: it is what
  // Unused::Predict / Exact handle.
  void declare_unused(const std::vector<std::string>& names_or_prefixes);

  // ---- Across the step boundary (GradSyncOptions::overlap) ------------------
  // The optimizer GradSync steps, bucket by bucket, once each bucket's
  // average has landed (LibTorch's SGD, Adam or AdamW, any param groups):
  // its own step() code on each bucket's parameters, with the options its
  // groups had when the step's backward began (a learning-rate schedule set
  // between steps applies to the next step), its state kept in it (save and
  // load it as usual, after synchronize()). Parameters equal, bit for bit,
  // those of calling optimizer.step() after a synced backward with
  // zero_grad() (set_to_none) before each step. Parameters no rank used are
  // not stepped, nor are frozen tensors (requires_grad false) the optimizer
  // holds, as step() skips them. With an optimizer attached the trainer
  // calls neither optimizer.step() nor zero_grad(): each bucket's gradients
  // are consumed by its update (.grad is the slot, zeroed after the
  // update). Required by Overlap::Optimizer and NextForward; call before the
  // first backward.
  // Global-norm clipping needs every gradient before any update: give the
  // limit to GradSync (GradSyncOptions::clip_grad_norm), which then steps
  // the buckets once all have landed (clip per bucket is not the same thing).
  void set_optimizer(torch::optim::Optimizer& optimizer);
  // The same with loss scaling (ddpx/amp.h): each bucket's average is
  // unscaled as it lands (ATen's _amp_foreach_non_finite_check_and_unscale_);
  // the buckets are stepped only once every one has landed finite, else
  // none is (the step is skipped on every rank: the averages are the same
  // everywhere; StepStats::skipped), and GradSync calls scaler.update().
  // The trainer calls scaler.scale(loss).backward() and nothing else of the
  // scaler's (its unscale_, step and update refuse). So the updates wait for
  // the last bucket (no update overlaps the tail of the reductions). Read
  // the scaler's state after synchronize() (GradSync holds on to it, also
  // if the scaler object goes first). Not with staleness(1) (refused).
  void set_optimizer(torch::optim::Optimizer& optimizer, GradScaler& scaler);
  // mixed_precision with a param_dtype below float32: the float32 masters,
  // one per parameter GradSync syncs, in its order (the tensors themselves:
  // read them after synchronize()); empty otherwise.
  std::vector<at::Tensor> master_parameters() const;
  // Overlap::NextForward: waits until the last step's updates (and rank 0's
  // buffers) have landed and every collective of the step is done, and
  // rethrows its failure if it failed. Call it before touching parameters
  // outside a gated forward (a checkpoint, the optimizer's state, your own
  // collectives on GradSync's groups); GradSync's own methods (no_sync,
  // declare_unused, prepare_for_backward, state, ...) call it themselves.
  // GradSyncOptions::staleness(1): waits for the last step's reductions and
  // applies its update, which would otherwise land at the end of the next
  // backward. Otherwise a no-op.
  void synchronize();
  // Overlap::NextForward: waits for these parameters' (or buffers') updates.
  // A scripted model's reads are gated by the graph pass the jit::Module
  // constructor runs (ddpx::param_ready before each read of a parameter or
  // buffer, in every method); a torch::nn module calls this before each
  // layer's forward, e.g. `sync.wait_ready(fc1->parameters())`. A parameter
  // read by a forward without its gate is found at the next backward and
  // fails the step (the read may have raced the update).
  void wait_ready(const std::vector<at::Tensor>& tensors);

  // While alive, backward accumulates locally; the next synced step reduces
  // the accumulated gradients.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(GradSync& s);
    ~NoSyncGuard();
   private:
    GradSync& s_;
  };
  NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  // What GradSync has learnt, for checkpoints: the current bucket plan's
  // parameter order and the order predictor's state. load_state re-plans at
  // once (by size: arrival times belong to the machine and are re-learnt);
  // call it between steps with the same state on every rank (e.g. a
  // checkpoint that rank 0 broadcast), so the plans stay identical.
  // residuals are this rank's own: per parameter (in GradSync's parameter
  // order), the codec's error feedback not sent yet (flat float32 of the
  // parameter's numel on its device, zeros where nothing is owed; all
  // undefined with codec "none"). A checkpoint keeps every rank's;
  // load_state gives each rank its own back (an empty vector leaves the
  // residuals as they are). warm_starts: per parameter, PowerSGD's Q^T
  // ([rank, numel / size(0)] float32; the same on every rank, so one rank's
  // is enough), undefined where there is none (other codecs, 1-D
  // parameters, before the first step); load_state sets the defined ones.
  // With both, a resumed run with any lossy codec continues bit for bit.
  // masters: mixed_precision's float32 masters (copies, in GradSync's
  // parameter order; empty without them); load_state sets them and rounds
  // them into the parameters (empty: taken from the parameters as they are).
  struct State {
    std::vector<int64_t> plan_order;
    std::vector<double> predictor;
    int64_t steps = 0;
    std::vector<at::Tensor> residuals;
    std::vector<at::Tensor> warm_starts;
    std::vector<at::Tensor> masters;
  };
  // After ranks are lost (comm::shrink_group, comm.h): state() of the old
  // GradSync, then a new one over the survivors' group and load_state().
  State state() const;
  void load_state(const State& s);

  const StepStats& last_step() const;

  // Profiling (hooks/profiler.h has the trace's protocol and tracks).
  ProfileSummary profile() const;
  std::string profile_summary() const;  // profile() as a fixed-width table
  // A trainer phase, e.g. `auto g = sync.phase("optimizer_step");`: a
  // "ddpx::<name>" range for torch.profiler and, in a traced step, an event on
  // the rank's step track, until the guard is destroyed.
  class PhaseGuard {
   public:
    ~PhaseGuard();
    PhaseGuard(PhaseGuard&&) noexcept;
    PhaseGuard& operator=(PhaseGuard&&) = delete;

   private:
    friend class GradSync;
    struct State;
    explicit PhaseGuard(std::unique_ptr<State> s);
    std::unique_ptr<State> s_;
  };
  PhaseGuard phase(const std::string& name);
  // Writes the trace now (collective when tracing: call it on every rank or
  // on none; later calls and the destructor then do nothing).
  void flush_trace();
  std::vector<std::vector<std::string>> bucket_plan() const;  // parameter names per bucket
  // GradSyncOptions::shard: the elements [first, second) of `param`
  // (flattened; a parameter GradSync syncs) whose optimizer state this rank
  // keeps; (0, numel) without sharding.
  std::pair<int64_t, int64_t> shard_range(const at::Tensor& param) const;
  // Sharded checkpoints at any world size: optimizer_shard(optimizer) is
  // this rank's part of `optimizer`'s state (LibTorch's SGD, Adam or AdamW
  // over GradSync's parameters), as bytes (write one file per rank, or
  // gather them into one checkpoint); load_optimizer_shards(optimizer,
  // count, shard) replaces its state by the elements this rank owns now of
  // every rank's shard of a checkpoint (shard(k) returns the k-th's bytes,
  // each read once, in any order; a missing or repeated one is an error), so
  // a job resumes at the same world size or another, sharded or not, the
  // state re-split by bytes. Neither holds the optimizer's options (param
  // groups, learning rates): restore those as usual, e.g. torch::load of one
  // rank's torch::save(optimizer), then load_optimizer_shards (which
  // replaces the state that loaded). Without sharding a shard is the whole
  // state. Local (no collective); between steps. (A whole, unsharded state
  // loaded into a sharded run's optimizer is cut to this rank's part at its
  // first step.)
  std::string optimizer_shard(torch::optim::Optimizer& optimizer) const;
  void load_optimizer_shards(torch::optim::Optimizer& optimizer, int count,
                             const std::function<std::string(int)>& shard);
  int64_t replans() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddpx
