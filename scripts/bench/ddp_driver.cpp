// ddpx-bench-ddp: the C++ side of scripts/bench/ddp. Under mpirun, loads
// scripted models (ddp_models.py, saved by the orchestrator) and times one
// training step (inputs -> forward -> backward -> gradients averaged ->
// zero_grad) per variant:
//
//   compute        forward + backward, no communication
//   comm_gloo/mpi  the same bytes all-reduced, no compute: buckets of
//                  --bucket-cap-mb launched back to back, then awaited
//   naive          after backward, all-reduce every gradient one by one and
//                  divide (the usual LibTorch loop), over Gloo
//   gradsync_gloo  ddpx::GradSync over Gloo (the transport of PyTorch DDP)
//   gradsync_mpi   ddpx::GradSync over ddpx_mpi
//   gradsync_gloo_unstaged, gradsync_mpi_unstaged (--device cuda; the
//                  orchestrator runs them as a job of their own) the same with
//                  stage_chunk_bytes(0): CUDA buckets handed to the backend,
//                  which stages them whole
//   gradsync_gloo_serial  the same with calls_in_flight(1): one bucket on
//                  the wire at a time (--focus)
//   gradsync_copy  GradSync over Gloo with gradient_as_bucket_view(false):
//                  gradients copied into the buckets and back (the benefit
//                  of views is gradsync_gloo vs this)
//   gradsync_solo  GradSync over a one-rank Gloo group per rank: the same
//                  hooks, final callback and write-back, but no traffic, so
//                  no communication thread competes with the hooks for the
//                  core; its hook time is the hook's own cost
//
// Models listed in --exact (those DDP runs with find_unused_parameters=True)
// use Unused::Exact: prepare_for_backward walks the graph from the loss, as
// DDP's find_unused_parameters does; the others use the default, Predict.
//
// The graph executor's optimisations are off here and in the DDP job (both
// run the scripted module as written, op by op, like eager): the profiling
// executor would otherwise re-compile differentiable graphs during the first
// steps, and its timing would be measured instead of synchronisation.
// Rank 0 prints one JSON object per (model, variant) on a line starting with
// "DDPX_BENCH ". Times are medians over the timed steps, in milliseconds;
// GradSync's StepStats figures are medians in microseconds.
#include <ddpx/comm.h>
#include <ddpx/grad_sync.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/cuda.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

namespace {

using Clock = std::chrono::steady_clock;
using ddpx::comm::ProcessGroupPtr;

struct Args {
  std::string dir;
  std::vector<std::string> models;
  std::vector<std::string> variants{"compute",       "comm_gloo",     "comm_mpi",
                                    "naive",         "gradsync_gloo", "gradsync_mpi",
                                    "gradsync_copy", "gradsync_solo", "gradsync_opt",
                                    "gradsync_gated", "gradsync_stale",
                                    "gradsync_stale_plain"};
  int warmup = 3, steps = 5, threads = 1;
  double bucket_cap_mb = 25.0;
  bool zero_in_place = false;  // zero_grad(set_to_none=false)
  std::vector<std::string> exact;  // models run with Unused::Exact
  std::string device = "cpu";      // cuda: model and inputs on GPU 0, each step synchronized
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<at::Tensor> params_of(const torch::jit::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters(/*recurse=*/true)) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

void zero_grad(const std::vector<at::Tensor>& params, bool in_place) {
  for (const auto& p : params) {
    if (in_place) {
      if (p.grad().defined()) p.grad().zero_();
    } else {
      const_cast<at::Tensor&>(p).mutable_grad().reset();
    }
  }
}

// exact: a GradSync in Unused::Exact mode, told the loss before backward.
// Times of one step's phases, in ms: inputs + forward (the part of a step no
// reduction can overlap while gradients must be averaged when backward
// returns), and the backward() call, with its start (gradient hooks time
// their arrival from it).
// On a device (sync_device) each phase ends with a device synchronize, so
// they time the kernels, not their launches; the gradients' arrival times
// stay the host's (when autograd queued them).
struct Phases {
  double forward = 0, backward = 0;
  Clock::time_point backward_start;
  bool sync_device = false;
};

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void forward_backward(torch::jit::Module& m, const at::Device& dev, int64_t step, int64_t rank,
                      ddpx::GradSync* exact = nullptr, Phases* phases = nullptr) {
  const auto t0 = Clock::now();
  at::Tensor x = m.run_method("inputs", step, rank).toTensor().to(dev);
  at::Tensor loss = m.forward({x, step}).toTensor();
  if (phases && phases->sync_device) torch::cuda::synchronize();
  if (phases) phases->forward = ms_since(t0);
  if (exact) exact->prepare_for_backward({loss});
  const auto t1 = Clock::now();
  if (phases) phases->backward_start = t1;
  loss.backward();
  if (phases && phases->sync_device) torch::cuda::synchronize();
  if (phases) phases->backward = ms_since(t1);
}

// The flat buffers comm-only reduces: the model's bytes in bucket-sized parts.
std::vector<at::Tensor> comm_buffers(const std::vector<at::Tensor>& params, double cap_mb,
                                     const at::Device& dev) {
  int64_t total = 0;
  for (const auto& p : params) total += p.numel();
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(cap_mb * (1 << 20)) / 4);
  std::vector<at::Tensor> out;
  for (int64_t off = 0; off < total; off += cap) out.push_back(at::ones({std::min(cap, total - off)}, at::TensorOptions(dev)));
  return out;
}

struct Groups {
  ProcessGroupPtr mpi, gloo, solo;
  ProcessGroupPtr gloo2;  // a second Gloo group: gradsync_gloo_2ch's second channel
};

nlohmann::json run_variant(const Args& a, const std::string& model, const std::string& variant,
                           const Groups& g) {
  const int rank = g.mpi->getRank(), world = g.mpi->getSize();
  torch::jit::Module m = torch::jit::load(a.dir + "/" + model + ".pt");
  const at::Device dev(a.device);
  m.to(dev);
  m.train();
  const auto params = params_of(m);
  int64_t numel = 0;
  for (const auto& p : params) numel += p.numel();

  std::optional<ddpx::GradSync> sync;
  // gradsync_stale_plain: the same without the look-ahead (what it costs).
  const bool stale = variant == "gradsync_stale" || variant == "gradsync_stale_plain";
  // staleness(1) takes Unused::Predict only (its step is exact about unused
  // parameters anyway, at its end); the other variants follow --exact.
  const bool exact =
      !stale && std::find(a.exact.begin(), a.exact.end(), model) != a.exact.end();
  // With an optimizer step (SGD, momentum): gradsync_opt steps it after
  // backward (the synchronous path), gradsync_gated gives it to GradSync
  // under Overlap::NextForward (updates land during the next forward),
  // gradsync_stale one step stale (each step's reductions overlap all of
  // the next step; its update lands at the end of that step's backward).
  const bool gated = variant == "gradsync_gated";
  const bool by_sync = gated || stale;  // GradSync steps the optimizer
  std::optional<torch::optim::SGD> sgd;
  if (variant == "gradsync_opt" || by_sync) {
    sgd.emplace(params, torch::optim::SGDOptions(1e-4).momentum(0.9));
  }
  if (variant.rfind("gradsync_", 0) == 0) {
    const bool mpi = variant.rfind("gradsync_mpi", 0) == 0;
    const bool unstaged = variant.size() > 9 && variant.substr(variant.size() - 9) == "_unstaged";
    ddpx::GradSyncOptions o;
    o.bucket_cap_mb(a.bucket_cap_mb)
        .stage_chunk_bytes(unstaged ? 0 : ddpx::GradSyncOptions{}.stage_chunk_bytes_)
        .gradient_as_bucket_view(variant != "gradsync_copy")
        .unused(exact ? ddpx::Unused::Exact : ddpx::Unused::Predict)
        .overlap(gated   ? ddpx::Overlap::NextForward
                 : stale ? ddpx::Overlap::Optimizer
                         : ddpx::Overlap::None)
        .staleness(stale ? 1 : 0)
        .stale_lookahead(variant != "gradsync_stale_plain")
        .stale_warmup(0);  // (the untimed warm-up steps are stale too)
    // gradsync_gloo_2ch: buckets alternate between two Gloo groups, two calls
    // in flight as DDP's one group with two threads has (issue 60: each Gloo
    // call cost 0.25-3 ms of fixed time on the H200's machine).
    if (variant == "gradsync_gloo_2ch") o.channels.push_back(g.gloo2);
    // gradsync_gloo_serial: one bucket on the wire at a time (what
    // calls_in_flight's default of two gains).
    if (variant == "gradsync_gloo_serial") o.calls_in_flight(1);
    sync.emplace(m, mpi ? g.mpi : variant == "gradsync_solo" ? g.solo : g.gloo, o);
    if (by_sync) sync->set_optimizer(*sgd);
  }
  ddpx::GradSync* exact_sync = sync && exact ? &*sync : nullptr;
  std::vector<at::Tensor> bufs;
  if (variant == "comm_gloo" || variant == "comm_mpi") bufs = comm_buffers(params, a.bucket_cap_mb, dev);

  std::function<void(int64_t)> step_fn;
  Phases phases;  // of the last step
  // (compute only: it has no communication that a sync would hold back)
  phases.sync_device = dev.is_cuda() && variant == "compute";
  // compute: when each gradient arrived in this step (ms from the backward()
  // call), for the floor that knows when each byte could first go on the
  // wire (scripts/bench/ddp). A post-hook on each accumulator, as GradSync's,
  // writing into storage allocated up front: with a JSON node allocated per
  // gradient instead, many520's forward slowed from 71 to ~300 ms a step and
  // the process grew (the heap fragmented between the activations, it
  // seems; the same hooks writing a double each left it at 71).
  std::vector<double> arrived(params.size(), -1.0);
  std::vector<std::vector<double>> arrivals;  // per timed step
  // (shared_ptr<Node> in torch 2.11, intrusive_ptr<Node> in 2.15)
  std::vector<decltype(torch::autograd::impl::grad_accumulator(params[0]))> accumulators;
  if (variant == "compute") {
    arrivals.assign(a.steps, std::vector<double>(params.size(), -1.0));
    for (size_t i = 0; i < params.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(params[i]);
      acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [&arrived, &phases, i](const torch::autograd::variable_list& outputs,
                                 const torch::autograd::variable_list&) {
            arrived[i] = ms_since(phases.backward_start);
            return outputs;
          }));
      accumulators.push_back(std::move(acc));
    }
  }
  if (variant == "compute" || sync) {
    step_fn = [&](int64_t s) {
      forward_backward(m, dev, s, rank, exact_sync, &phases);
      if (sgd && !by_sync) sgd->step();
    };
  } else if (variant == "naive") {
    step_fn = [&](int64_t s) {
      forward_backward(m, dev, s, rank);
      torch::NoGradGuard no_grad;
      for (const auto& p : params) {
        if (!p.grad().defined()) continue;  // unused here: skipped on every rank alike
        std::vector<at::Tensor> t{p.grad()};
        g.gloo->allreduce(t)->wait();
        p.grad().div_(world);
      }
    };
  } else if (!bufs.empty()) {
    auto pg = variant == "comm_gloo" ? g.gloo : g.mpi;
    step_fn = [&, pg](int64_t) {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (auto& b : bufs) {
        std::vector<at::Tensor> t{b};
        works.push_back(pg->allreduce(t));
      }
      for (auto& w : works) w->wait();
    };
  } else {
    TORCH_CHECK(false, "ddpx-bench-ddp: unknown variant '", variant, "'");
  }

  std::vector<double> ms, fwd_ms, bwd_ms, hook_us, param_hook_us, calls, exposed_us, backward_us, comm_us;
  int64_t replans = 0, buckets = 0;
  // Gated: past the first priority trial too (8 steps with priority, 8
  // without, once the plan holds buckets: hooks/priority_trial.h), so the
  // timed steps run what the trial chose.
  const int warmup = gated ? a.warmup + 20 : a.warmup;
  g.mpi->barrier()->wait();
  for (int s = 0; s < warmup + a.steps; ++s) {
    std::fill(arrived.begin(), arrived.end(), -1.0);  // -1: no gradient (yet)
    const auto t0 = Clock::now();
    step_fn(s);
    if (!by_sync) zero_grad(params, a.zero_in_place);  // (else GradSync's updates consume them)
    if (dev.is_cuda()) torch::cuda::synchronize();  // the step's kernels, as DDP's side times them
    const double dt = ms_since(t0);
    if (s < warmup) continue;
    ms.push_back(dt);
    fwd_ms.push_back(phases.forward);
    bwd_ms.push_back(phases.backward);
    if (variant == "compute") arrivals[s - a.warmup] = arrived;  // into storage allocated up front
    // (Gated, stale: last_step() would wait for the step's reductions, which
    // the next step must overlap; its records are read after the loop.)
    if (sync && !by_sync) {
      const auto& st = sync->last_step();
      hook_us.push_back(st.hook_cpu_us);
      param_hook_us.push_back(st.per_param_hooks_us);
      calls.push_back(static_cast<double>(st.hook_calls));
      exposed_us.push_back(st.exposed_comm_us);
      backward_us.push_back(st.backward_us);
      comm_us.push_back(st.comm_us);
      replans = st.replans;
      buckets = static_cast<int64_t>(st.buckets.size());
    }
  }
  if (by_sync) {
    sync->synchronize();
    const auto prof = sync->profile();  // medians over every step, warm-up included
    hook_us.push_back(prof.hook_cpu_us);
    exposed_us.push_back(prof.exposed_comm_us);
    backward_us.push_back(prof.backward_us);
    comm_us.push_back(prof.comm_us);
    param_hook_us.push_back(0);
    calls.push_back(static_cast<double>(params.size()));
    replans = sync->replans();
    buckets = static_cast<int64_t>(sync->bucket_plan().size());
  }
  nlohmann::json j = {{"model", model}, {"variant", variant}, {"world", world},
                      {"tensors", params.size()}, {"numel", numel},
                      {"step_ms", median(ms)}, {"min_ms", *std::min_element(ms.begin(), ms.end())},
                      {"steps", a.steps}, {"warmup", a.warmup}};
  if (variant == "compute" || sync) j["forward_ms"] = median(fwd_ms);
  if (variant == "compute") {
    // Per timed step: the phases, and [ms, bytes] of each gradient that came.
    nlohmann::json steps = nlohmann::json::array();
    for (size_t k = 0; k < arrivals.size(); ++k) {
      nlohmann::json grads = nlohmann::json::array();
      for (size_t i = 0; i < params.size(); ++i) {
        if (arrivals[k][i] >= 0) grads.push_back({arrivals[k][i], params[i].nbytes()});
      }
      steps.push_back({{"forward_ms", fwd_ms[k]},
                       {"backward_ms", bwd_ms[k]},
                       {"grads", std::move(grads)}});
    }
    j["arrivals"] = std::move(steps);
  }
  if (sync) {
    j.update({{"hook_cpu_us", median(hook_us)}, {"param_hooks_us", median(param_hook_us)},
              {"hook_calls", median(calls)},
              {"exposed_comm_us", median(exposed_us)}, {"backward_us", median(backward_us)},
              {"comm_us", median(comm_us)}, {"replans", replans}, {"buckets", buckets}});
    if (gated) {
      j["gate_wait_us"] = sync->profile().gate_wait_us;
      // The last timed step's: the trial's choice, the buckets it held and
      // the bytes of a cut bucket they overtook.
      const auto& last = sync->last_step();
      j["priority_on"] = last.priority_on;
      int held = 0;
      int64_t overtaken = 0;
      for (const auto& b : last.buckets) {
        held += b.held ? 1 : 0;
        overtaken += b.held_bytes;
      }
      j["held_buckets"] = held;
      j["overtaken_mb"] = static_cast<double>(overtaken) / 1e6;
    }
  }
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"ddpx-bench-ddp: C++ variants of scripts/bench/ddp (run under mpirun)"};
  app.add_option("--models-dir", a.dir, "directory of <model>.pt from ddp_models.export")->required();
  app.add_option("--models", a.models, "model names (comma- or space-separated)")
      ->required()
      ->delimiter(',');
  app.add_option("--variants", a.variants, "variants to run, in this order");
  app.add_option("--warmup", a.warmup, "untimed steps per variant");
  app.add_option("--steps", a.steps, "timed steps per variant");
  app.add_option("--threads", a.threads, "intra-op threads per rank");
  app.add_option("--bucket-cap-mb", a.bucket_cap_mb, "GradSync bucket cap and comm-only part size");
  app.add_flag("--zero-in-place", a.zero_in_place, "zero_grad(set_to_none=false)");
  app.add_option("--exact", a.exact, "models whose GradSync uses Unused::Exact")->delimiter(',');
  app.add_option("--device", a.device, "cpu, or cuda (both ranks on GPU 0)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  CLI11_PARSE(app, argc, argv);
  TORCH_CHECK(a.steps > 0, "--steps must be positive, got ", a.steps);

  at::set_num_threads(a.threads);
  torch::jit::setGraphExecutorOptimize(false);
  Groups g;
  g.mpi = ddpx::comm::init_from_env();
  g.gloo = ddpx::comm::make("gloo");
  ddpx::comm::MakeOptions solo;
  solo.store = c10::make_intrusive<c10d::HashStore>();
  solo.rank = 0;
  solo.size = 1;
  solo.name = "solo";
  g.solo = ddpx::comm::make("gloo", solo);
  ddpx::comm::MakeOptions second;
  second.name = "gloo2";
  g.gloo2 = ddpx::comm::make("gloo", second);
  for (const auto& model : a.models) {
    for (const auto& variant : a.variants) {
      auto j = run_variant(a, model, variant, g);
      if (g.mpi->getRank() == 0) std::cout << "DDPX_BENCH " << j.dump() << std::endl;
    }
  }
  return 0;
}
