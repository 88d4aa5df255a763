#pragma once
// GradSync's options (ddpx/grad_sync.h), and the enums they take: overlap,
// sharding and unused-parameter handling.
#include <c10/core/ScalarType.h>
#include <ddpx/comm.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ddpx {

// Where a step's barrier sits (see "Across the step boundary" in ddpx/grad_sync.h).
enum class Overlap {
  None,         // backward returns with .grad averaged; the trainer steps its optimizer
  Optimizer,    // GradSync steps the optimizer bucket by bucket as averages land;
                // backward returns with the parameters updated
  NextForward,  // backward returns once every gradient is in its bucket; updates land
                // during the next forward, each parameter read waits for its own
  // On a device with streams (CUDA) the updates are queued, never waited
  // for by the host: on the stream backward's caller runs on, after the
  // bucket's reduction on its channel's stream; a gate opens once its update
  // is queued and makes the reading stream wait for it.
};

// Sharded training state (ZeRO; GradSyncOptions::shard).
enum class Shard {
  None,       // every rank holds the whole optimizer state and gradient
  Optimizer,  // ZeRO-1: each rank keeps optimizer state for its 1/W of the parameters
  Gradients,  // ZeRO-2: and gradient memory for its part only, once a bucket is reduced
};

enum class Unused {
  Off,      // every parameter must get a gradient every step (else: error naming it)
  Predict,  // learn which go unused, plan them into late buckets; exact at the end
  Exact,    // walk the graph from prepare_for_backward(outputs), like DDP
};

struct GradSyncOptions {
#define DDPX_OPT(type, name, def)          \
  GradSyncOptions& name(type v) {          \
    name##_ = std::move(v);                \
    return *this;                          \
  }                                        \
  type name##_ = def;
  DDPX_OPT(double, bucket_cap_mb, 25.0)
  DDPX_OPT(double, first_bucket_mb, 1.0)  // small first bucket: starts communicating early
  DDPX_OPT(std::string, codec, "none")
  DDPX_OPT(Unused, unused, Unused::Predict)
  DDPX_OPT(bool, replan, true)            // learn the order and re-plan buckets
  // Plan by the learnt arrival times and the link's measured rate as well
  // (cuts where backward pauses, re-plans that finish earlier, priority's
  // held buckets). Off: a plan depends only on the order and on which
  // parameters go unused, so it is the same on every run of the same model.
  // The codecs' results do not depend on the plan (int8's chunks and top-k's
  // budget are per tensor, residuals follow their parameters through a
  // re-plan), except PowerSGD's: its warm-start factors are kept per bucket
  // and start cold after a re-plan, so a powersgd run repeats only with this
  // off, at the cost of what the overlap timing buys.
  DDPX_OPT(bool, timed_plans, true)
  DDPX_OPT(bool, broadcast_on_init, true)
  // After every synced backward, rank 0's buffers (BatchNorm's running
  // statistics, ...) are broadcast, so the next forward sees the same buffers
  // on every rank: DDP's broadcast_buffers, which does it before each
  // forward (the same values: nothing changes buffers in between).
  DDPX_OPT(bool, broadcast_buffers, true)
  // Chrome/Perfetto trace of GradSync's phases, merged over ranks by rank 0
  // into this file ("": the DDPX_TRACE environment variable; unset: off).
  DDPX_OPT(std::string, trace, "")
  // Steps traced, "a:b" inclusive and 1-based, "a:" or ":b" open-ended
  // ("": DDPX_TRACE_STEPS, else "1:20"). The file is written when the window
  // ends, at flush_trace() or at destruction, whichever comes first.
  DDPX_OPT(std::string, trace_steps, "")
  // .grad of a synced parameter is a view of its bucket slot (as DDP's
  // gradient_as_bucket_view): no copy into the bucket or back. Its storage is
  // overwritten by the next synced backward; clone a .grad to keep it.
  DDPX_OPT(bool, gradient_as_bucket_view, true)
  // Parameters whose gradients are sparse (an Embedding(sparse=true)'s
  // "weight"): a bucket of their own, reduced as rows, from the first step.
  // Others are learnt from their first sparse gradient, after one step
  // through a dense slot. The torch::jit::Module constructor adds the
  // weights of submodules whose constant `sparse` is true, as DDP finds
  // nn.Embedding(sparse=True).
  DDPX_OPT(std::vector<std::string>, sparse_params, {})
  // Layer dropping: name prefixes of the units a trainer may declare unused
  // for a step (declare_unused), e.g. {"blocks.0.", "blocks.1.", ...}. Each
  // unit's parameters get buckets of their own, so a dropped unit skips
  // whole buckets (a unit's codec state then waits, whole, for its next
  // send). Optional: without it, a partly dropped bucket sends the runs of
  // its kept slots.
  DDPX_OPT(std::vector<std::string>, drop_units, {})
  // Across the step boundary (set_optimizer gives the optimizer): see Overlap.
  DDPX_OPT(Overlap, overlap, Overlap::None)
  // NextForward: the buckets that would wait for the link past the end of
  // backward anyway are held and launched at its end first layer first
  // (predicted from the learnt arrival times and the link's rate; planned
  // by rank 0, the same on every rank), so the next forward's first gates
  // open first. Measured: when a plan first holds buckets and every 500
  // steps after, 8 steps run with priority and 8 first in, first out, and
  // priority stays on only if rank 0's median step was shorter with it.
  // Off: first in, first out.
  DDPX_OPT(bool, priority, true)
  // One step stale (0 or 1; 1 needs Overlap::Optimizer): step t's gradients
  // are averaged during step t+1's forward and backward and applied at the
  // end of step t+1's backward, before its own go out, so a step costs
  // about max(compute, communication). Inexact by design: step t+1's
  // gradients are computed on parameters that lack step t's update. The
  // first stale_warmup synced steps of this GradSync are synchronous (a
  // resumed run, with a new GradSync, warms up again). Delayed gradients
  // make momentum much less stable unless stale_lookahead is on (below):
  // see the README. synchronize() (and
  // state(), load_state(), set_optimizer(), the destructor) applies the
  // update still pending, so a checkpoint after it has nothing in flight.
  // Not with Unused::Exact, declare_unused or sparse gradients (refused).
  DDPX_OPT(int, staleness, 0)
  DDPX_OPT(int, stale_warmup, 10)
  // With staleness(1): at the end of each backward, after the last step's
  // exact update, every rank takes one look-ahead step of the optimizer on
  // its own gradients of this step (on a copy of the optimizer's state,
  // which is then dropped) and runs the next forward there; the average's
  // update replaces it a step later. The delay then applies to the
  // gradient noise only, not to the curvature, so momentum stays as
  // stable as synchronous SGD. The ranks' parameters differ by their
  // look-ahead between steps; the committed ones, on which every exact
  // update lands, are the same on every rank, and synchronize() (a
  // checkpoint, state()) leaves the parameters there. Off: the next
  // forward runs on the committed parameters (each average applied
  // exactly one step late).
  DDPX_OPT(bool, stale_lookahead, true)
  // Sharded training state (ZeRO-1/2). The parameters' bytes, in
  // GradSync's parameter order, are cut into W contiguous ranges of equal
  // size, rank r owning [r*T/W, (r+1)*T/W) (an element goes with its first
  // byte: a tensor may be split, a rank may own nothing of a small one); the
  // split depends on the parameters and W only, never on the bucket plan.
  // Each bucket is reduced to its owners (a rank receives the average of
  // its own part of the bucket: a reduce per owner, a reduce-scatter with
  // uneven parts; over Gloo an all-to-all in pieces, the owner adding the
  // ranks' pieces in rank order), the optimizer given to set_optimizer (required in every
  // overlap mode; it must hold every parameter GradSync syncs) steps only
  // the owned elements, its state allocated for them alone, and every owner
  // broadcasts its updated part of the bucket back into the parameters --
  // an all-reduce's bytes in all. The buckets go whole (a late or partly
  // declared bucket's unused slots too). Updates land as under the overlap
  // mode: before backward returns (None, Optimizer: during backward, each
  // bucket stepped on a thread of GradSync's own once its reduction lands
  // and gathered behind the next bucket's reduction -- under
  // Unused::Predict the ranks' flags of which of its parameters they used
  // are MAX-reduced in front of the reduction, so an owner steps what any
  // rank used; late buckets, and every bucket under Unused::Exact,
  // declare_unused or clip_grad_norm, after the step-end agreement), or
  // behind the next forward (NextForward: each parameter's gate opens once
  // its gather has landed).
  // The optimizer's state stays in the trainer's optimizer, keyed by the
  // parameter as usual but the size of this rank's part (flat: exp_avg of
  // a [n] slice), so optimizer.save() on each rank writes that rank's shard
  // (GradSync::shard_range says which elements), and a job resumed at the
  // same world size loads it back as usual.
  // Gradients: bucket storage exists only while a bucket is in use in a
  // step (from its first gradient to the end of its reduction; this rank's
  // part of the average then until its step; the gather goes in pieces of
  // a few MiB); .grad is
  // released as soon as it is copied into its bucket (under no_sync it
  // accumulates, whole, as usual) and undefined after the step.
  // Optimizer: buckets persist and .grad is a view of its (zeroed) slot
  // after each step, as without sharding.
  // Codecs: "none" (exact: the parameters bit for bit those of the
  // unsharded run where the sums add in the same order -- MPI's reduce and
  // all-reduce here, any two ranks -- and within rounding elsewhere, e.g.
  // over Gloo beyond two ranks), and the sharded forms of "fp16",
  // "bf16" (bit for bit the unsharded codec's run) and "int8" (chunks cut at
  // the owners' bounds: within the codec's bound of the unsharded one) --
  // Codec::reduce_scatter_mean_packed; each rank's error-feedback residual
  // covers the whole bucket (its contributions to every owner), float32
  // state of a gradient's size outside the Gradients bound. top-k and
  // PowerSGD are refused (their compression is over whole tensors).
  // Not with staleness(1), mixed_precision or sparse gradients (refused,
  // naming the option). A GradScaler is refused too (its verdict would need
  // every rank's part).
  DDPX_OPT(Shard, shard, Shard::None)
  // Global-norm gradient clipping where GradSync steps the optimizer
  // (set_optimizer; 0: off): once every bucket's average has landed, they
  // are scaled as torch::nn::utils::clip_grad_norm_(params, max_norm) would
  // (its own code on the whole averages; sharded: its formula over every
  // rank's parts, the norm summed by one all-reduce of a double), then
  // stepped. So no update overlaps the tail of the reductions. Without an
  // optimizer given, call clip_grad_norm_ after backward yourself.
  DDPX_OPT(double, clip_grad_norm, 0.0)
  // CUDA buckets over a backend that reduces host memory only (Gloo;
  // ddpx_mpi unless MPI is CUDA-aware), exact path (codec "none"): staged
  // through a pinned host buffer in chunks of this many bytes, copies out
  // and back pipelined with the chunks' reductions (two on the wire at a
  // time) on the channel's stream
  // (0: the bucket goes to the backend as it is, which stages it whole). The
  // trace's `staged_chunks` says which path each bucket took.
  DDPX_OPT(int64_t, stage_chunk_bytes, int64_t{4} << 20)
  // Buckets on the wire at once per process group, exact path (codec
  // "none"): the next bucket's all-reduce starts once the last one's has
  // started, not ended, as DDP's buckets do on PyTorch's Gloo group (two
  // threads), so a collective's fixed cost overlaps the next one's. Every
  // rank starts them in the same order. A codec's reduction, the step-end
  // agreement and a sharded bucket's collectives still run one at a time.
  // 1: one bucket at a time.
  DDPX_OPT(int, calls_in_flight, 2)
#undef DDPX_OPT
  // Mixed precision (FSDP's MixedPrecision(param_dtype, reduce_dtype); each
  // float32, bfloat16 or float16). param_dtype below float32: GradSync
  // keeps a float32 master copy of every parameter it syncs, taken at
  // construction (after rank 0's broadcast), and converts the parameters in
  // place -- the same tensors, in the model and in the optimizer, frozen
  // ones too -- to param_dtype, so forward and backward compute in it (cast
  // floating inputs to it, as FSDP's cast_forward_inputs does). The
  // optimizer given to set_optimizer, required then in every overlap mode
  // (under Overlap::None as under Optimizer: bucket by bucket as the
  // averages land, before backward returns; with a GradScaler once all
  // have landed, see set_optimizer),
  // steps the masters with float32 gradients, its state float32 and kept in
  // it under the parameters as usual; the stepped masters are rounded into
  // the parameters the next forward reads. The masters are in state() (a
  // checkpoint) and master_parameters(). reduce_dtype: the buckets' dtype,
  // in which gradients are summed (bfloat16 gradients summed in float32, or
  // float32 ones in bfloat16); the codec, if any, compresses a bucket of
  // that dtype. Beside codec("bf16"): mixed_precision(kFloat, kBFloat16)
  // sends float32 gradients as bfloat16 too, but sums them in bfloat16 on
  // the backend (a rounding per partial sum beyond two ranks), keeps no
  // error feedback and halves the buckets' memory; the bf16 codec keeps
  // float32 buckets, sums in float32 in rank order with one rounding, and
  // carries what the rounding lost into the next step (both send 2 bytes
  // per element). Memory per parameter, before activations (which shrink
  // with param_dtype), and before the optimizer's float32 state: float32
  // 4 (parameter) + 4 (bucket, which .grad views); (bf16, fp32) 2 + 4
  // (master) + 4 (bucket, which the master's .grad views) + 2 (the
  // parameter's .grad, during backward); (bf16, bf16) 2 + 4 + 2 (bucket,
  // which the parameter's .grad views) + 4 (the master's float32 .grad,
  // during the update). Under no_sync, micro-batches accumulate in
  // param_dtype. Not with staleness(1) or sparse_params (refused).
  GradSyncOptions& mixed_precision(at::ScalarType param_dtype, at::ScalarType reduce_dtype) {
    param_dtype_ = param_dtype;
    reduce_dtype_ = reduce_dtype;
    return *this;
  }
  std::optional<at::ScalarType> param_dtype_, reduce_dtype_;
  // Extra process groups: buckets go round-robin over {pg, channels...}.
  std::vector<comm::ProcessGroupPtr> channels;
};

}  // namespace ddpx
