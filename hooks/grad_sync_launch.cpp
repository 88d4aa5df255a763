// GradSync: launching a bucket's reduction on its channel (the whole bucket,
// or a late bucket's used runs) and the error-feedback residuals a re-plan
// leaves owed to parameters, added to their slots when next sent. Called
// under Impl::mu from the hooks and the final callback (grad_sync_impl.h).
#include <utility>

#include "hooks/grad_sync_impl.h"
#include "hooks/sparse_reduce.h"

namespace ddpx {

void GradSync::Impl::carry_residuals() {
  if (!lossy) return;
  for_each_param_residual(lossy->take_residuals(),
                          [this](int p, const at::Tensor& r) { owe(p, r); });
  run_origin.clear();
}

std::vector<at::Tensor> GradSync::Impl::owed_residuals() const {
  std::vector<at::Tensor> out(params.size());
  if (!lossy) return out;  // "none": no error feedback
  auto add = [&out](int p, const at::Tensor& r) {
    const at::Tensor flat = r.reshape(-1).to(at::kFloat);
    out[p] = out[p].defined() ? out[p] + flat : flat.clone();
  };
  for_each_param_residual(lossy->residuals(), add);
  for (size_t p = 0; p < params.size(); ++p) {
    if (carry[p].defined()) add(static_cast<int>(p), carry[p]);
    if (!out[p].defined()) out[p] = at::zeros({info[p].numel}, params[p].options().dtype(at::kFloat));
  }
  return out;
}

void GradSync::Impl::for_each_param_residual(
    const std::map<std::string, at::Tensor>& by_key,
    const std::function<void(int, const at::Tensor&)>& fn) const {
  for (const auto& [key, r] : by_key) {
    int b = -1;
    int64_t off = 0;
    if (auto it = run_origin.find(key); it != run_origin.end()) {
      std::tie(b, off) = it->second;
    } else {
      for (size_t i = 0; i < keys.size(); ++i) {
        if (keys[i] == key) b = static_cast<int>(i);
      }
    }
    if (b < 0 || b >= static_cast<int>(plan.size())) continue;
    for (int p : plan[b].params) {
      const int64_t rel = offset_of[p] - off;
      if (rel < 0 || rel + info[p].numel > r.numel()) continue;  // not in this run
      fn(p, r.narrow(0, rel, info[p].numel));
    }
  }
}

void GradSync::Impl::owe(int p, const at::Tensor& r) {
  std::lock_guard<std::mutex> lock(carry_mu);
  if (carry[p].defined()) {
    carry[p].add_(r.reshape(-1));
  } else {
    carry[p] = r.reshape(-1).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    ++carries;
  }
}

void GradSync::Impl::launch_locked(int b, std::vector<Run> runs, std::future<void>* into) {
  if (plan[b].sparse) {
    launch_sparse_locked(b);
    return;
  }
  hooks::Range range("ddpx::bucket_launch");
  auto& bs = stats.buckets[b];
  bs.launch_us = hooks::us_since(t0, Clock::now());
  if (runs.empty()) runs.push_back({0, plan[b].numel});
  int64_t numel = 0;
  for (const auto& r : runs) numel += r.numel;
  bs.bytes = numel * static_cast<int64_t>(c10::elementSize(plan[b].dtype));
  // A codec keeps state per key: a partial run has its own (one per layout
  // seen). The whole bucket uses the bucket's key, which only changes at a
  // re-plan, after every future.
  std::vector<std::string> run_keys;
  std::vector<hooks::Shapes> run_shapes;  // of the parameters in each run
  std::vector<std::vector<std::string>> run_part_keys;
  if (numel != plan[b].numel) {
    for (const auto& r : runs) {
      run_keys.push_back(keys[b] + "@" + std::to_string(r.offset) + "+" + std::to_string(r.numel));
      run_origin.emplace(run_keys.back(), std::make_pair(b, r.offset));
      run_shapes.emplace_back();
      run_part_keys.emplace_back();
      for (size_t i = 0; i < plan[b].params.size(); ++i) {
        const int p = plan[b].params[i];
        if (offset_of[p] >= r.offset && offset_of[p] < r.offset + r.numel) {
          run_shapes.back().push_back(params[p].sizes().vec());
          run_part_keys.back().push_back(part_keys[b][i]);
        }
      }
    }
  }
  const size_t n_runs = runs.size();
  auto owed = take_carries_locked(b, runs);
  std::vector<c10::Storage> keep;  // device residuals: made on this stream, freed on the channel's
  for (const auto& o : owed) keep.push_back(o.second.storage());
  at::Tensor flat = storage[b];
  // (The bucket's key and shapes change only at a re-plan, after every future.)
  const std::string* key = &keys[b];
  const hooks::Shapes* bucket_shapes = &shapes[b];
  const std::vector<std::string>* bucket_part_keys = &part_keys[b];
  auto body = [this, flat, key, bucket_shapes, bucket_part_keys, runs = std::move(runs),
               run_keys = std::move(run_keys), run_shapes = std::move(run_shapes),
               run_part_keys = std::move(run_part_keys),
               owed = std::move(owed)](c10d::ProcessGroup& pg) mutable {
    for (auto& [slot, r] : owed) slot.add_(r.view(slot.sizes()));
    if (run_keys.empty()) {
      reduce(flat, *key, *bucket_shapes, *bucket_part_keys, pg);
    } else {
      for (size_t i = 0; i < runs.size(); ++i) {
        at::Tensor part = flat.narrow(0, runs[i].offset, runs[i].numel);
        reduce(part, run_keys[i], run_shapes[i], run_part_keys[i], pg);
      }
    }
  };
  // Exact path, one run: the body is one allreduce_sum (reduce_fn.cpp), whose
  // last start the channel hears of; a codec's collectives run alone. So do
  // a priority launch's buckets (held, and the cut one's parts): they are to
  // land in the order launched, each with the whole link.
  const bool one_sum = !lossy && n_runs == 1;
  const bool by_priority = priority_now && (plan[b].held || plan[b].held_from > 0);
  submit_locked(
      b, std::move(body), std::move(keep), into, comm::detail::FrOp::kAllReduce,
      one_sum && !by_priority ? hooks::Channel::Tail::kOverlaps : hooks::Channel::Tail::kSerial);
}

void GradSync::Impl::launch_rest_locked() {
  if (split_sent < 0) return;
  const int b = std::exchange(split_sent, -1);
  auto& bs = stats.buckets[b];
  const double first_launch = bs.launch_us;
  const int64_t first_bytes = bs.bytes;
  launch_locked(b, {{plan[b].held_from, plan[b].numel - plan[b].held_from}}, &rest_futures[b]);
  bs.held_bytes = bs.bytes;
  bs.bytes += first_bytes;
  bs.launch_us = first_launch;
}

void GradSync::Impl::launch_sparse_locked(int b) {
  hooks::Range range("ddpx::bucket_launch");
  auto& bs = stats.buckets[b];
  bs.launch_us = hooks::us_since(t0, Clock::now());
  const int p = plan[b].params.front();
  auto keep = hooks::storages_of(sparse_in[p]);  // the gradient, made on backward's stream
  // Written on the channel thread before the future is ready; read after it.
  auto body = [local = sparse_in[p], param = params[p], sd = planned_sparse_dim[p],
               out = &sparse_out[p], bytes = &bs.bytes](c10d::ProcessGroup& pg) {
    auto r = hooks::sparse_average(pg, local, param, sd);
    *out = std::move(r.avg);
    *bytes = r.wire_bytes;
  };
  submit_locked(b, std::move(body), std::move(keep));
}

void GradSync::Impl::submit_locked(int b, std::function<void(c10d::ProcessGroup&)> body,
                                   std::vector<c10::Storage> keep, std::future<void>* into,
                                   comm::detail::FrOp op, hooks::Channel::Tail tail) {
  if (fr_group >= 0) body = recorded_locked(fr_call(b, op), std::move(body));
  const bool gather = op == comm::detail::FrOp::kAllGather;  // (traced apart from the reduction)
  double* complete = gather ? nullptr : &stats.buckets[b].complete_us;
  const auto start = t0;
  const int c = b % static_cast<int>(channels.size());
  std::future<void>& future = into ? *into : futures[b];
  if (!hooks::has_streams(plan[b].device)) {
    future = channels[c]->submit(
        [body = std::move(body), complete, start,
         ctx = profiler->launch_context(b, gather)](c10d::ProcessGroup& pg) mutable {
          {
            hooks::ReduceScope scope(ctx);
            body(pg);
          }
          if (complete) *complete = hooks::us_since(start, Clock::now());
        },
        tail);
    return;
  }
  // A device bucket: its reduction runs on the channel's stream, after the
  // streams that wrote its slots (this one included: a late bucket's zeroing
  // in the final callback), and finish_step waits for `reduced[b]`.
  note_writer_locked(b);
  auto before = std::make_shared<hooks::StreamFence>();
  for (const auto& s : wrote_on[b]) before->add(s);
  auto done = std::make_shared<hooks::StreamFence>();
  reduced[b] = done;  // (a cut bucket's remainder: on the same stream, after its first part)
  future = channels[c]->submit(
      [body = std::move(body), complete, start, ctx = profiler->launch_context(b, gather), before,
       done, keep = std::move(keep),
       comm = channels[c]->stream(plan[b].device)](c10d::ProcessGroup& pg) mutable {
        {
          hooks::ReduceScope scope(ctx);
          hooks::run_on_stream(
              comm, *before, keep, [&] { body(pg); }, done.get());
        }
        if (complete) *complete = hooks::us_since(start, Clock::now());
      },
      tail);
}

comm::detail::FlightRecorder::Call GradSync::Impl::fr_call(int b, comm::detail::FrOp op) const {
  comm::detail::FlightRecorder::Call call;
  call.op = op;
  call.dtype = plan[b].dtype;
  const int64_t bytes = stats.buckets[b].bytes;  // a partial launch's runs (sparse: 0)
  call.numel = bytes > 0 ? bytes / static_cast<int64_t>(c10::elementSize(plan[b].dtype))
                         : plan[b].numel;
  call.step = stats.step;
  call.bucket = b;
  call.names = b < static_cast<int>(fr_names.size()) ? fr_names[b] : -1;
  return call;
}

std::function<void(c10d::ProcessGroup&)> GradSync::Impl::recorded_locked(
    comm::detail::FlightRecorder::Call call, std::function<void(c10d::ProcessGroup&)> body) {
  if (fr_group < 0) return body;
  call.group = fr_group;
  call.seq = ++fr_seq;
  const uint64_t id = comm::detail::FlightRecorder::get().record(call);
  return [body = std::move(body), id](c10d::ProcessGroup& pg) {
    auto& fr = comm::detail::FlightRecorder::get();
    fr.started(id);
    try {
      body(pg);
    } catch (...) {
      fr.finished(id, /*failed=*/true);
      throw;
    }
    fr.finished(id);
  };
}

std::vector<std::pair<at::Tensor, at::Tensor>> GradSync::Impl::take_carries_locked(
    int b, const std::vector<Run>& runs) {
  std::vector<std::pair<at::Tensor, at::Tensor>> owed;
  std::lock_guard<std::mutex> lock(carry_mu);
  if (carries == 0) return owed;
  for (int p : plan[b].params) {
    if (!carry[p].defined()) continue;
    for (const auto& r : runs) {
      if (offset_of[p] >= r.offset && offset_of[p] < r.offset + r.numel) {
        owed.emplace_back(views[p], std::move(carry[p]));
        carry[p] = at::Tensor();
        --carries;
        break;
      }
    }
  }
  return owed;
}

bool GradSync::Impl::idle_in_step(int b, int p, const std::vector<char>& globally_used) const {
  return declared[p] || (plan[b].late && !globally_used.empty() && !globally_used[p]);
}

std::vector<GradSync::Impl::Run> GradSync::Impl::sent_runs(
    int b, const std::vector<char>& globally_used, bool sent) const {
  std::vector<Run> runs;
  for (int p : plan[b].params) {
    if (idle_in_step(b, p, globally_used) == sent) continue;
    const int64_t off = offset_of[p], n = info[p].numel;
    if (!runs.empty() && runs.back().offset + runs.back().numel == off) {
      runs.back().numel += n;
    } else {
      runs.push_back({off, n});
    }
  }
  return runs;
}

}  // namespace ddpx
