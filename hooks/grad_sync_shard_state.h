#pragma once
// GradSync's sharded state (GradSyncOptions::shard: ZeRO-1/2), a base of
// GradSync::Impl (grad_sync_impl.h), whose methods in grad_sync_shard.cpp
// use it: who owns which elements, the owned views the optimizer steps, each
// bucket's gather, Shard::Gradients' short-lived bucket storage, and the
// buckets stepped during backward. Data only: inactive (Shard::None), all of
// it stays empty.
#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <future>
#include <memory>
#include <vector>

#include "hooks/channel.h"
#include "hooks/shard_map.h"

namespace ddpx::hooks {

struct ShardedState {
  // Who owns which elements; per bucket, its owners' parts; per parameter, a
  // flat view of the elements this rank owns (undefined: none), which the
  // optimizer steps; per bucket, its gather (the owners' updated parts
  // broadcast) in flight this step.
  ShardMap shard;
  std::vector<std::vector<ShardPart>> shard_parts;
  std::vector<at::Tensor> shard_views;
  std::vector<std::future<void>> gathers;
  // Sent by sharded reductions so far (reduce_fn is not used), and their
  // float32-equivalent (CodecStats::bytes_raw).
  int64_t shard_bytes = 0, shard_raw = 0;

  // Shard::Gradients: bucket storage lives from a step's first use of the
  // bucket to the end of its reduction, which keeps this rank's part of
  // the average (owned_grads, per bucket) until the bucket is stepped; a
  // gather sends in pieces (shard_reduce.h). Gradient memory held now, and the most
  // this step (ProfileSummary::grad_buffer_bytes), kept by Impl::account().
  std::vector<at::Tensor> owned_grads;
  // Per bucket: its owned_grads entry is a view of the bucket itself (a
  // bucket stepped during backward), which lives, and counts in
  // bucket_bytes, until the step.
  std::vector<char> owned_in_bucket;
  std::atomic<int64_t> storage_bytes{0};
  std::atomic<int64_t> storage_peak{0};
  int64_t last_storage_peak = 0;  // the last completed step's
  // Of storage_bytes, the buckets' (made, not yet freed by their
  // reduction), and the most of them a backward runs ahead with: two of the
  // plan's largest buckets (one filling, one on the wire; set by replan).
  std::atomic<int64_t> bucket_bytes{0};
  int64_t bucket_limit = 0;
  // Backward's waits for that room this step (StepStats::memory_wait_us):
  // nanoseconds and count, from the hooks' threads.
  std::atomic<int64_t> memory_wait_ns{0}, memory_waits{0};

  // A bucket stepped during backward (Impl::steps_early): its step runs on
  // `stepper` once its reduction has landed, while its channel goes on with
  // the next reduction; its gather is queued on its channel behind the next
  // bucket's reduction (or at the end of backward, before the agreement):
  // R0 R1 G0 R2 G1 ... on every rank.
  struct EarlyStep {
    int bucket = -1;
    // The ranks' used flags of its parameters, MAX-reduced in front of the
    // reduction (undefined: Unused::Off, all used).
    at::Tensor flags;
    // Set by the reduction (on the bucket's channel thread, read by the
    // gather on the same thread): it succeeded; the step it started.
    bool reduced = false;
    std::future<void> stepped;
  };
  std::unique_ptr<Channel> stepper;          // a thread; its group is not used
  std::shared_ptr<EarlyStep> early_pending;  // the last one whose gather is not queued
};

}  // namespace ddpx::hooks
