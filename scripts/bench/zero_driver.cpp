// ddpx-bench-zero: the C++ side of scripts/bench/zero. One case per process,
// so that the kernel's peak resident set (VmHWM) is that case's alone:
//
//   gs        GradSync, Shard::None; under Overlap::None the trainer zeroes
//             .grad in place before the step and calls adam.step() after
//             backward (as DDP's peer does: .grad stays a view of its bucket)
//   gs_zero1  GradSync, Shard::Optimizer: GradSync steps the Adam itself
//   gs_zero2  GradSync, Shard::Gradients: the same, bucket memory only while
//             a bucket is in use
//
// With --overlap optimizer or next_forward every case gives GradSync the Adam
// (gs too), so the cases differ by the sharding alone.
//
// The process group is whatever ddpx::comm::init_from_env() finds: Gloo
// when the orchestrator starts this with torchrun's variables (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the transport of the Python peers.
// The model is a scripted one from scripts/bench/zero (loss = m(m.inputs(step,
// rank), step)). Each rank writes one JSON object to --out: its step times
// (ms), their median, and its memory in bytes (parameters, Adam's state,
// gradient buckets at their peak, VmRSS before anything was loaded, VmHWM at
// the end).
#include <ddpx/comm.h>
#include <ddpx/grad_sync.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string model, name, kase = "gs", overlap = "none", codec = "none", unused = "predict", out;
  int warmup = 3, steps = 5, threads = 1, round = 0;
  double lr = 1e-3, bucket_cap_mb = 25.0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// A memory field of /proc/self/status (VmRSS, VmHWM) in bytes; the kernel
// writes kB.
int64_t status_bytes(const std::string& field) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind(field + ":", 0) == 0) {
      std::istringstream in(line.substr(field.size() + 1));
      int64_t kb = 0;
      in >> kb;
      return kb * 1024;
    }
  }
  TORCH_CHECK(false, "/proc/self/status has no ", field);
}

// Adam's state in bytes, counted alike in every case (gs gives GradSync no
// optimizer, so ProfileSummary::optimizer_state_bytes is 0 there): the
// moment tensors, as the Python side counts them (its scalar `step` left out).
int64_t adam_state_bytes(const torch::optim::Adam& adam) {
  auto bytes = [](const at::Tensor& t) {
    return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  };
  int64_t total = 0;
  for (const auto& [key, st] : adam.state()) {
    if (const auto* a = dynamic_cast<const torch::optim::AdamParamState*>(st.get())) {
      total += bytes(a->exp_avg()) + bytes(a->exp_avg_sq()) + bytes(a->max_exp_avg_sq());
    }
  }
  return total;
}

ddpx::Shard shard_of(const std::string& kase) {
  if (kase == "gs_zero1") return ddpx::Shard::Optimizer;
  if (kase == "gs_zero2") return ddpx::Shard::Gradients;
  return ddpx::Shard::None;
}

ddpx::Overlap overlap_of(const std::string& overlap) {
  if (overlap == "optimizer") return ddpx::Overlap::Optimizer;
  if (overlap == "next_forward") return ddpx::Overlap::NextForward;
  return ddpx::Overlap::None;
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

nlohmann::json run(const Args& a) {
  // Before the group, the model and the optimizer: what the case adds to the
  // process is VmHWM minus this.
  const int64_t base_rss = status_bytes("VmRSS");
  at::set_num_threads(a.threads);
  // As in ddp_driver.cpp and the Python peers: the scripted graph as
  // written, not re-compiled by the profiling executor during the warm-up.
  torch::jit::setGraphExecutorOptimize(false);
  auto pg = ddpx::comm::init_from_env();
  const int rank = pg->getRank();
  torch::jit::Module m = torch::jit::load(a.model);
  m.train();
  std::vector<at::Tensor> params;
  for (const auto& p : m.parameters(/*recurse=*/true)) {
    if (p.requires_grad()) params.push_back(p);
  }
  torch::optim::Adam adam(params, torch::optim::AdamOptions(a.lr));
  const ddpx::Shard shard = shard_of(a.kase);
  const ddpx::Overlap overlap = overlap_of(a.overlap);
  // Sharding needs GradSync to step the optimizer (only it knows which
  // elements are this rank's); so do the overlapped modes.
  const bool by_sync = shard != ddpx::Shard::None || overlap != ddpx::Overlap::None;
  const auto options = ddpx::GradSyncOptions()
                           .bucket_cap_mb(a.bucket_cap_mb)
                           .shard(shard)
                           .overlap(overlap)
                           .codec(a.codec)
                           .unused(a.unused == "off" ? ddpx::Unused::Off : ddpx::Unused::Predict);
  ddpx::GradSync sync(m, pg, options);
  if (by_sync) sync.set_optimizer(adam);

  std::vector<double> ms;
  pg->barrier()->wait();
  for (int s = 0; s < a.warmup + a.steps; ++s) {
    const auto t0 = Clock::now();
    if (!by_sync) adam.zero_grad(/*set_to_none=*/false);
    at::Tensor x = m.run_method("inputs", s, rank).toTensor();
    m.forward({x, s}).toTensor().backward();
    if (!by_sync) adam.step();
    const double dt = ms_since(t0);
    if (s >= a.warmup) ms.push_back(dt);
  }
  sync.synchronize();  // NextForward: the last step's updates land
  const auto prof = sync.profile();
  return {{"case", a.kase},
          {"model", a.name},
          {"rank", rank},
          {"world", pg->getSize()},
          {"round", a.round},
          {"overlap", a.overlap},
          {"codec", a.codec},
          {"unused", a.unused},
          {"step_ms", median(ms)},
          {"times_ms", ms},
          {"param_bytes", prof.param_bytes},
          {"state_bytes", adam_state_bytes(adam)},
          // GradSync's own count, for the sharded cases (0 without an optimizer)
          {"sync_state_bytes", prof.optimizer_state_bytes},
          {"grad_bytes", prof.grad_buffer_bytes},
          // gs_zero2: backward's median wait for bucket memory a step
          {"memory_wait_ms", prof.memory_wait_us / 1e3},
          {"base_rss", base_rss},
          {"peak_rss", status_bytes("VmHWM")}};
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"ddpx-bench-zero: one GradSync case of scripts/bench/zero (Gloo, torchrun env)"};
  app.add_option("--model", a.model, "scripted model (.pt) with inputs(step, rank)")->required();
  app.add_option("--name", a.name, "the model's name in the record");
  app.add_option("--case", a.kase, "gs, gs_zero1 or gs_zero2")
      ->check(CLI::IsMember({"gs", "gs_zero1", "gs_zero2"}));
  app.add_option("--overlap", a.overlap, "none, optimizer or next_forward")
      ->check(CLI::IsMember({"none", "optimizer", "next_forward"}));
  app.add_option("--warmup", a.warmup, "untimed steps");
  app.add_option("--steps", a.steps, "timed steps");
  app.add_option("--threads", a.threads, "intra-op threads");
  app.add_option("--lr", a.lr, "Adam's learning rate");
  app.add_option("--codec", a.codec, "GradSync's codec (sharded: none, fp16, bf16 or int8)");
  app.add_option("--bucket-cap-mb", a.bucket_cap_mb, "GradSync's bucket cap");
  app.add_option("--unused", a.unused,
                 "GradSync's Unused mode: predict or off (DDP's default, "
                 "find_unused_parameters=False)")
      ->check(CLI::IsMember({"predict", "off"}));
  app.add_option("--round", a.round, "echoed in the record");
  app.add_option("--out", a.out, "file for this rank's JSON record (default: stdout)");
  CLI11_PARSE(app, argc, argv);
  TORCH_CHECK(a.steps > 0, "--steps must be positive, got ", a.steps);
  TORCH_CHECK(a.warmup >= 0, "--warmup must be >= 0, got ", a.warmup);

  const auto j = run(a);
  if (a.out.empty()) {
    std::cout << j.dump() << std::endl;
  } else {
    std::ofstream(a.out) << j.dump() << "\n";
  }
  return 0;
}
