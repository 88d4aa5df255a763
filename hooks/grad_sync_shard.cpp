// GradSync's sharded step (GradSyncOptions::shard, ZeRO-1/2; who owns what:
// hooks/shard_map.h). Per bucket: the reduction goes to the owners (a
// reduce-scatter with uneven parts, hooks/shard_reduce.h; a codec's encoded
// parts in one all-to-all, Codec::reduce_scatter_mean_packed), the owned
// elements are stepped by the trainer's optimizer (hooks/bucket_optimizer.h,
// on flat views of the parameters), each owner writes its updated elements
// into the bucket -- the gradients there are consumed -- and sends them to
// every rank (the gather), after which every rank copies the bucket into its
// parameters. Bytes on the wire: an all-reduce's worth.
// Under Overlap None and Optimizer a reliable bucket's step and gather run
// during backward (steps_early): stepped on `stepper` once reduced, gathered
// behind the next bucket's reduction; otherwise after the step-end
// agreement (complete_step).
#include <c10/core/StreamGuard.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "hooks/grad_sync_impl.h"
#include "hooks/shard_reduce.h"
#include "hooks/shard_state.h"

namespace ddpx {

void GradSync::Impl::account(int64_t bytes) {
  const int64_t now = storage_bytes += bytes;
  int64_t peak = storage_peak.load();
  while (now > peak && !storage_peak.compare_exchange_weak(peak, now)) {
  }
}

void GradSync::Impl::make_room(int b) {
  if (storage[b].defined()) return;
  const int64_t need = plan[b].numel * static_cast<int64_t>(c10::elementSize(plan[b].dtype));
  while (bucket_bytes.load() + need > bucket_limit) {
    std::future<void>* oldest = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu);
      // (A gather holds no bucket: gather_body's pieces.)
      for (int j : launch_seq) {
        std::future<void>& f = futures[j];
        if (f.valid() && f.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
          oldest = &f;
          break;
        }
      }
    }
    if (!oldest) return;  // nothing on the wire: what fills must be made
    hooks::Range r("ddpx::gradient_memory_wait");
    const auto w0 = Clock::now();
    oldest->wait();  // (its failure is complete_step's to report)
    memory_wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - w0).count();
    ++memory_waits;
  }
}

void GradSync::Impl::ensure_storage(int b) {
  if (storage[b].defined()) return;
  const auto& bp = plan[b];
  at::Tensor flat = at::zeros({bp.numel}, at::TensorOptions().dtype(bp.dtype).device(bp.device));
  for (int p : bp.params) {
    views[p] = flat.narrow(0, offset_of[p], info[p].numel).view(params[p].sizes()).detach();
  }
  storage[b] = flat;
  account(static_cast<int64_t>(flat.nbytes()));
  bucket_bytes += static_cast<int64_t>(flat.nbytes());
}

void GradSync::Impl::drop_storage(int b) {
  for (int p : plan[b].params) views[p] = at::Tensor();
  storage[b] = at::Tensor();
}

const hooks::ShardPart* GradSync::Impl::my_part(int b) const {
  for (const auto& part : shard_parts[b]) {
    if (part.rank == shard.rank()) return &part;
  }
  return nullptr;
}

void GradSync::Impl::launch_sharded_locked(int b, const std::vector<char>& anywhere) {
  hooks::Range range("ddpx::bucket_launch");
  ensure_storage(b);  // (no gradient of it came here)
  auto& bs = stats.buckets[b];
  bs.launch_us = hooks::us_since(t0, Clock::now());
  bs.bytes = plan[b].numel * static_cast<int64_t>(c10::elementSize(plan[b].dtype));
  if (!lossy) {  // (a codec counts what it sends)
    shard_bytes += bs.bytes;
    shard_raw += 4 * plan[b].numel;
  }
  at::Tensor flat = storage[b];
  std::vector<c10::Storage> keep;
  // Error feedback a re-plan left owed: added to the slots before encoding.
  auto owed = take_carries_locked(b, {{0, plan[b].numel}});
  for (const auto& o : owed) keep.push_back(o.second.storage());
  // A codec: the slots of parameters no rank uses this step (sent_runs'
  // rule) go out with the rest, but their residual is put back after the
  // call -- no rank steps them, so the error they owe waits for a step that
  // does (as unsharded, which leaves them out of the call).
  std::vector<Run> idle;
  if (lossy) idle = unsent_runs(b, anywhere);
  at::Tensor* owned = nullptr;  // Gradients: where this rank's averaged part goes
  const hooks::ShardPart* mine = my_part(b);
  if (transient_storage()) {
    // The bucket goes with its reduction, which frees it once this rank's
    // part is out (no hook touches it again this step).
    keep.push_back(flat.storage());  // (a device: made on backward's stream)
    drop_storage(b);
    owned = &owned_grads[b];
  }
  // Stepped during backward (steps_early, below): the part can stay where
  // it is, in the bucket, which then goes with the step.
  const bool early_step = steps_early() && !plan[b].late;
  auto body = [this, b, flat, parts = shard_parts[b], owned, owed = std::move(owed),
               idle = std::move(idle), early_step,
               mine = mine ? std::optional<hooks::ShardPart>(*mine)
                           : std::nullopt](c10d::ProcessGroup& pg) mutable {
    at::Tensor mean;  // a codec's: this rank's part of the average
    if (lossy) {
      for (auto& [slot, r] : owed) slot.add_(r.view(slot.sizes()));
      mean = scatter_through_codec(b, flat, parts, idle, pg);
      if (mine && !owned) flat.narrow(0, mine->offset, mine->numel).copy_(mean);
    } else {
      // Divided before the sum, as the unsharded "none" does (reduce_fn.cpp):
      // the same averages, bit for bit where MPI sums in the same order.
      if (world > 1) {
        flat.div_(world);
        hooks::reduce_to_owners(flat, parts, pg);
      }
    }
    if (!owned) return;
    if (mine && early_step && !mean.defined()) {
      // (A copy of the part beside the whole bucket, then the bucket freed,
      // peaked at both: on mlp25m at 2 ranks, whose largest bucket is 2/3
      // of the model, above the unsharded run's memory. step_sharded frees
      // the bucket and counts it off.)
      *owned = flat.narrow(0, mine->offset, mine->numel);
      owned_in_bucket[b] = 1;
      flat = at::Tensor();
      return;
    }
    if (mine) {
      *owned = mean.defined() ? mean : flat.narrow(0, mine->offset, mine->numel).clone();
      account(static_cast<int64_t>(owned->nbytes()));
    }
    account(-static_cast<int64_t>(flat.nbytes()));
    bucket_bytes -= static_cast<int64_t>(flat.nbytes());
    flat = at::Tensor();
  };
  // Stepped and gathered during backward (steps_early): whether some rank
  // used each parameter of the bucket decides whether its owner steps it (a
  // parameter no rank used is not stepped). Under Off every one was (else
  // the step fails at its end on the rank that missed one); under Predict
  // one unused here may be used elsewhere, so the ranks MAX-reduce the
  // bucket's flags first, a few ints in front of its reduction (there the
  // link is quiet and the ranks meet anyway: behind the reduction, the
  // round trip queued behind its last bytes and cost more than it saves).
  std::shared_ptr<EarlyStep> early;
  if (early_step) {  // (a late one is stepped after the agreement)
    early = std::make_shared<EarlyStep>();
    if (opts.unused_ != Unused::Off) {
      const auto& ps = plan[b].params;
      early->flags = at::zeros({static_cast<int64_t>(ps.size())}, at::kInt);
      int* f = early->flags.data_ptr<int>();
      for (size_t i = 0; i < ps.size(); ++i) {
        f[i] = arrival_us[ps[i]] >= 0 ||
               std::find(carried.begin(), carried.end(), ps[i]) != carried.end();
      }
    }
  }
  // The flags' all-reduce runs in the reduction's job, but is a
  // flight-recorder record of its own, just before the reduction's.
  std::function<void(c10d::ProcessGroup&)> agree_flags;
  if (early) {
    early->bucket = b;
    if (early->flags.defined()) {
      auto call = fr_call(b, comm::detail::FrOp::kAllReduce);
      call.numel = early->flags.numel();
      call.dtype = at::kInt;
      agree_flags = recorded_locked(call, [flags = early->flags](c10d::ProcessGroup& pg) {
        std::vector<at::Tensor> v{flags};
        c10d::AllreduceOptions o;
        o.reduceOp = c10d::ReduceOp::MAX;
        comm::detail::wait_named(pg.allreduce(v, o));
      });
    }
  }
  auto step = [this, b, flags = early ? early->flags : at::Tensor()] {
    std::vector<int> agreed;
    if (flags.defined()) {
      agreed.assign(params.size(), 0);
      const int* f = flags.const_data_ptr<int>();
      for (size_t i = 0; i < plan[b].params.size(); ++i) agreed[plan[b].params[i]] = f[i];
    }
    hooks::Range range("ddpx::shard_step");
    step_sharded(b, land_sharded(b, agreed.empty() ? nullptr : agreed.data(), true));
  };
  submit_locked(
      b,
      [this, body = std::move(body), early, step = std::move(step),
       agree_flags = std::move(agree_flags),
       device = plan[b].device](c10d::ProcessGroup& pg) mutable {
        if (agree_flags) agree_flags(pg);
        body(pg);
        if (!early) return;
        early->reduced = true;
        // (A device: on this channel's stream, after the reduction.)
        std::optional<c10::Stream> on;
        if (hooks::has_streams(device)) on = hooks::current_stream(device);
        early->stepped = stepper->submit([step = std::move(step), on](c10d::ProcessGroup&) {
          std::optional<c10::StreamGuard> guard;
          if (on) guard.emplace(*on);
          step();
        });
      },
      std::move(keep), nullptr, comm::detail::FrOp::kReduceScatter);
  queue_early_gather_locked();  // the last bucket's, behind this reduction
  if (early) early_pending = std::move(early);
}

bool GradSync::Impl::steps_early() const {
  // Not: NextForward, whose gathers go first layer first behind the next
  // forward; Exact and declarations, whose agreement may yet fail the step
  // (no update may have run then); clipping, which needs every bucket's
  // average first. (Sharding refuses a GradScaler and staleness.)
  return stepper && shard.active() && optimizer && !gates && opts.unused_ != Unused::Exact &&
         n_declared == 0 && opts.clip_grad_norm_ <= 0;
}

void GradSync::Impl::queue_early_gather_locked() {
  if (!early_pending) return;
  auto early = std::move(early_pending);
  early_pending.reset();
  const int b = early->bucket;
  submit_locked(
      b,
      [early, gather = gather_body(b)](c10d::ProcessGroup& pg) mutable {
        if (!early->reduced) return;  // (the reduction's failure is complete_step's to report)
        early->stepped.get();
        gather(pg);
      },
      {}, &gathers[b], comm::detail::FrOp::kAllGather);
}

at::Tensor GradSync::Impl::scatter_through_codec(int b, const at::Tensor& flat,
                                                 const std::vector<hooks::ShardPart>& parts,
                                                 const std::vector<Run>& idle,
                                                 c10d::ProcessGroup& pg) {
  // (The bucket's key and shapes change only at a re-plan, after every future.)
  const std::string& key = keys[b];
  std::vector<comm::Codec::Run> runs;
  for (const auto& part : parts) runs.push_back({part.offset, part.numel, part.rank});
  std::vector<at::Tensor> owe;  // the idle slots' residuals, before the call
  const at::Tensor before = idle.empty() ? at::Tensor() : lossy->live_residual(key);
  for (const auto& r : idle) {
    owe.push_back(before.defined() ? before.narrow(0, r.offset, r.numel).clone() : at::Tensor());
  }
  at::Tensor mean = lossy->reduce_scatter_mean_packed(flat, shapes[b], runs, key, pg);
  const at::Tensor after = idle.empty() ? at::Tensor() : lossy->live_residual(key);
  for (size_t i = 0; i < idle.size() && after.defined(); ++i) {
    at::Tensor e = after.narrow(0, idle[i].offset, idle[i].numel);
    owe[i].defined() ? e.copy_(owe[i]) : e.zero_();
  }
  return mean;
}

std::vector<int> GradSync::Impl::land_sharded(int b, const int* agreed, bool on_channel) {
  // A device bucket: queued on this thread's stream after the reduction
  // (on the channel: its stream, which ran the reduction).
  const c10::Device device = plan[b].device;
  if (!on_channel && hooks::has_streams(device) && reduced[b]) {
    const auto here = hooks::current_stream(device);
    reduced[b]->block(here);
    // The owned average (Gradients), made on the channel's stream, is read
    // here by the optimizer and freed right after it is queued
    // (step_sharded): unmarked, its block would go back to the channel's
    // stream at once, for a later bucket's reduction to overwrite before the
    // optimizer has read it.
    hooks::mark_in_use(owned_grads[b], here);
  }
  const hooks::ShardPart* mine = my_part(b);
  std::vector<int> stepped;
  for (int p : plan[b].params) {
    const auto [lo, hi] = shard.mine(p);
    auto owned_mean = [&, lo = lo, hi = hi] {
      return transient_storage()
                 ? owned_grads[b].narrow(0, offset_of[p] + lo - mine->offset, hi - lo)
                 : views[p].view(-1).narrow(0, lo, hi - lo);
    };
    // Unused on every rank: not stepped, as without sharding. A codec: its
    // slots were sent, carrying the ranks' residuals for it (a reliable
    // bucket's; in late ones they were put back), and no rank applies the
    // mean -- so the owner owes it again, world times over: the residuals'
    // sum over the ranks, all that error feedback needs, is conserved.
    // (Unsharded, every rank owes the mean; only the owner has it here.)
    if (agreed && agreed[p] == 0) {
      if (lossy && hi > lo && !plan[b].late && !declared[p]) {
        at::Tensor owed = at::zeros({info[p].numel}, owned_mean().options().dtype(at::kFloat));
        owed.narrow(0, lo, hi - lo).copy_(owned_mean()).mul_(shard.world());
        owe(p, owed);
      }
      continue;
    }
    if (!optimizer->steps(p)) continue;
    shard_views[p].mutable_grad() = owned_mean();
    stepped.push_back(p);
  }
  return stepped;
}

void GradSync::Impl::step_sharded(int b, const std::vector<int>& stepped) {
  at::NoGradGuard no_grad;
  optimizer->apply(b, stepped);
  for (int p : stepped) shard_views[p].mutable_grad() = at::Tensor();
  if (owned_grads[b].defined()) {
    // (A part kept in its bucket: the bucket's bytes.)
    const auto bytes = static_cast<int64_t>(owned_in_bucket[b] ? owned_grads[b].storage().nbytes()
                                                               : owned_grads[b].nbytes());
    owned_grads[b] = at::Tensor();
    account(-bytes);
    if (owned_in_bucket[b]) bucket_bytes -= bytes;
    owned_in_bucket[b] = 0;
  }
}

void GradSync::Impl::gather_sharded(int b) {
  auto body = gather_body(b);
  std::lock_guard<std::mutex> lock(mu);
  submit_locked(b, std::move(body), {}, &gathers[b], comm::detail::FrOp::kAllGather);
}

std::function<void(c10d::ProcessGroup&)> GradSync::Impl::gather_body(int b) {
  const c10::Device device = plan[b].device;
  // The gather: each owner's elements of every parameter of the bucket
  // (stepped or not) broadcast in the bucket itself (its gradients are
  // consumed), then copied into every rank's parameters; or, Gradients,
  // whose bucket went with its reduction, in pieces of a few MiB, each
  // filled from the owner's elements and copied into the others'
  // parameters (a bucket-sized buffer made per gather, as first built, took
  // ZeRO-2's gradient memory past the unsharded run's on mlp25m at 2 ranks:
  // 117 MB against 101).
  struct Slot {
    at::Tensor param;  // flat
    int64_t offset;    // in the bucket
    at::Tensor owned;  // this rank's elements (shard_views), or undefined
    int64_t owned_at;  // their first index in the parameter
  };
  std::vector<Slot> slots;
  for (int p : plan[b].params) {
    slots.push_back(
        {params[p].detach().view(-1), offset_of[p], shard_views[p], shard.mine(p).first});
  }
  return [this, buffer = storage[b],
          options = at::TensorOptions().dtype(plan[b].dtype).device(device), parts = shard_parts[b],
          slots = std::move(slots), times = &stats.buckets[b],
          start = t0](c10d::ProcessGroup& pg) mutable {
    at::NoGradGuard no_grad;
    times->gather_us = hooks::us_since(start, Clock::now());
    if (buffer.defined()) {
      for (const auto& s : slots) {
        if (s.owned.defined())
          buffer.narrow(0, s.offset + s.owned_at, s.owned.numel()).copy_(s.owned);
      }
      hooks::gather_from_owners(buffer, parts, pg);
      for (const auto& s : slots) s.param.copy_(buffer.narrow(0, s.offset, s.param.numel()));
    } else {
      // Bucket coordinates: a slot's elements are [offset, offset + numel),
      // its owned ones [offset + owned_at, ... + owned.numel()).
      auto overlap = [](int64_t a, int64_t an, int64_t b, int64_t bn) {
        const int64_t lo = std::max(a, b), hi = std::min(a + an, b + bn);
        return std::pair<int64_t, int64_t>(lo, std::max<int64_t>(hi - lo, 0));
      };
      auto fill = [&slots, &overlap](int64_t at, const at::Tensor& piece) {
        for (const auto& s : slots) {
          if (!s.owned.defined()) continue;
          const auto [lo, n] = overlap(s.offset + s.owned_at, s.owned.numel(), at, piece.numel());
          if (n > 0) {
            piece.narrow(0, lo - at, n).copy_(s.owned.narrow(0, lo - s.offset - s.owned_at, n));
          }
        }
      };
      auto take = [&slots, &overlap](int64_t at, const at::Tensor& piece) {
        for (const auto& s : slots) {
          const auto [lo, n] = overlap(s.offset, s.param.numel(), at, piece.numel());
          if (n > 0) s.param.narrow(0, lo - s.offset, n).copy_(piece.narrow(0, lo - at, n));
        }
      };
      hooks::gather_from_owners_in_pieces(parts, options, pg, fill, take,
                                          [this](int64_t bytes) { account(bytes); });
    }
    times->gathered_us = hooks::us_since(start, Clock::now());
  };
}

void GradSync::Impl::finish_sharded(int b) {
  at::NoGradGuard no_grad;
  const c10::Device device = plan[b].device;
  // The gradients were consumed by the update (those of parameters no rank
  // used: by the gather, which overwrote their slots). Gradients: .grad is
  // undefined; Optimizer: zeroed, and .grad stays (or becomes) its slot, so
  // the next backward accumulates into the bucket.
  // (On a device: after the gather, on this thread's stream.)
  if (hooks::has_streams(device) && reduced[b]) reduced[b]->block(hooks::current_stream(device));
  if (transient_storage()) {
    for (int p : plan[b].params) params[p].mutable_grad() = at::Tensor();
  } else {
    for (int p : plan[b].params) {
      auto& g = params[p].mutable_grad();
      if (g.defined() && !is_slot(p, g)) {
        g = opts.gradient_as_bucket_view_ ? views[p] : at::Tensor();
      }
    }
    storage[b].zero_();
  }
  if (gates) {
    const auto queued = hooks::fence_current({device});
    for (int p : plan[b].params) gates->open(p, queued);
  }
}

}  // namespace ddpx

namespace ddpx {

std::pair<int64_t, int64_t> GradSync::shard_range(const at::Tensor& param) const {
  const auto& I = *impl_;
  for (size_t p = 0; p < I.params.size(); ++p) {
    if (I.params[p].is_same(param)) return I.owned_ranges()[p];
  }
  TORCH_CHECK(false, "GradSync::shard_range: the tensor (shape ", param.sizes(),
              ") is not a parameter GradSync synchronises");
}

}  // namespace ddpx

namespace ddpx {

std::vector<std::pair<int64_t, int64_t>> GradSync::Impl::owned_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t p = 0; p < params.size(); ++p) {
    out.push_back(shard.active() ? shard.mine(static_cast<int>(p))
                                 : std::pair<int64_t, int64_t>{0, info[p].numel});
  }
  return out;
}

std::string GradSync::optimizer_shard(torch::optim::Optimizer& optimizer) const {
  auto& I = *impl_;
  const_cast<GradSync*>(this)->synchronize();  // (nothing in flight)
  const auto owned = I.owned_ranges();
  return hooks::save_shard(optimizer, {I.names, I.params, owned, I.shard.active()},
                           I.shard.active() ? I.shard.world() : 1,
                           I.shard.active() ? I.shard.rank() : 0);
}

void GradSync::load_optimizer_shards(torch::optim::Optimizer& optimizer, int count,
                                     const std::function<std::string(int)>& shard) {
  auto& I = *impl_;
  synchronize();
  TORCH_CHECK(count > 0, "GradSync::load_optimizer_shards: count is ", count);
  std::lock_guard<std::mutex> lock(I.mu);
  TORCH_CHECK(!I.active, "GradSync::load_optimizer_shards: called during backward");
  const auto owned = I.owned_ranges();
  hooks::load_shards(optimizer, {I.names, I.params, owned, I.shard.active()}, count, shard);
}

}  // namespace ddpx
