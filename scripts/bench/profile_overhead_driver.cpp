// The profiler-overhead benchmark's C++ side (GradSync has no Python
// binding): two identical models, one synced by a GradSync with tracing off
// and one by a GradSync tracing every step, trained in alternating steps so
// drift and other load hit both alike. Rank 0 prints one JSON line with the
// median step time and hook CPU per parameter tensor of each.
//
//   mpirun -np 2 ddpx_profile_overhead --params 600 --width 32 --steps 200 --trace /tmp/t.json
#include <ddpx/grad_sync.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

torch::nn::Sequential make_model(int layers, int width) {
  torch::manual_seed(42);
  torch::nn::Sequential m;
  for (int i = 0; i < layers; ++i) {
    m->push_back(torch::nn::Linear(width, width));
    m->push_back(torch::nn::Tanh());
  }
  return m;
}

struct Side {
  torch::nn::Sequential model;
  std::unique_ptr<ddpx::GradSync> sync;
  std::unique_ptr<torch::optim::SGD> opt;
  std::vector<double> step_us, hook_per_param_us;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GradSync profiler overhead: tracing off vs on, alternating steps"};
  int params = 600, width = 32, steps = 200, warmup = 10, batch = 8;
  std::string trace = "/tmp/ddpx_profile_overhead.json", codec = "none";
  double bucket_mb = 25;
  app.add_option("--params", params, "parameter tensors (2 per Linear layer)")
      ->check(CLI::Range(2, 100000));
  app.add_option("--width", width, "Linear width")->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "rows per rank")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "timed steps per side")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps per side")->check(CLI::NonNegativeNumber);
  app.add_option("--trace", trace, "trace file of the traced side");
  app.add_option("--codec", codec, "GradSync codec");
  app.add_option("--bucket-mb", bucket_mb, "bucket cap (MB)")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  torch::set_num_threads(1);  // ranks share the machine's cores
  auto pg = ddpx::comm::init_from_env();
  const int layers = params / 2;
  const int total = steps + warmup;
  Side off, on;
  for (Side* s : {&off, &on}) {
    s->model = make_model(layers, width);
    auto o = ddpx::GradSyncOptions().codec(codec).bucket_cap_mb(bucket_mb);
    if (s == &on) o.trace(trace).trace_steps("1:");  // every step: the worst case
    s->sync = std::make_unique<ddpx::GradSync>(s->model->named_parameters(), pg, o);
    s->opt =
        std::make_unique<torch::optim::SGD>(s->model->parameters(), torch::optim::SGDOptions(1e-3));
  }
  auto x = torch::randn({batch, width}) * (pg->getRank() + 1);
  for (int i = 0; i < total; ++i) {
    // Alternate which side goes first, so neither always follows the other.
    Side* order[2] = {i % 2 ? &on : &off, i % 2 ? &off : &on};
    for (Side* s : order) {
      const auto t0 = std::chrono::steady_clock::now();
      s->opt->zero_grad();
      s->model->forward(x).pow(2).mean().backward();
      {
        auto g = s->sync->phase("optimizer_step");
        s->opt->step();
      }
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      if (i < warmup) continue;
      s->step_us.push_back(us);
      const auto& st = s->sync->last_step();
      s->hook_per_param_us.push_back(st.hook_cpu_us / static_cast<double>(st.hook_calls));
    }
  }
  const auto p_off = off.sync->profile(), p_on = on.sync->profile();
  on.sync->flush_trace();
  if (pg->getRank() == 0) {
    auto side = [](const Side& s, const ddpx::ProfileSummary& p) {
      return nlohmann::json{{"step_us", median(s.step_us)},
                            {"hook_cpu_per_param_us", p.hook_cpu_per_param_us},
                            {"hook_cpu_us", p.hook_cpu_us},
                            {"backward_us", p.backward_us},
                            {"hook_and_final_cpu_per_param_us", median(s.hook_per_param_us)}};
    };
    nlohmann::json out = {{"params", static_cast<int64_t>(on.model->parameters().size())},
                          {"world", pg->getSize()},
                          {"steps", steps},
                          {"off", side(off, p_off)},
                          {"on", side(on, p_on)},
                          {"trace_bytes", std::filesystem::file_size(trace)}};
    std::cout << out.dump() << std::endl;
    std::cerr << on.sync->profile_summary();
  }
  return 0;
}
