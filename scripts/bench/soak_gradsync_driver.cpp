// The soak's GradSync churn (scripts/bench/soak): constructs and destroys a
// GradSync `--iterations` times in one process, each doing one synced step,
// and prints one JSON line (rank 0) with this process's resident memory, open
// file descriptors and threads after the warm-up and at the end. Built in
// build-asan too, where LeakSanitizer checks the exit.
//
//   mpirun -np 2 ddpx_soak_gradsync --iterations 1000
#include <ddpx/comm.h>
#include <ddpx/grad_sync.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

namespace {

// VmRSS (kB) and Threads of /proc/self/status, and the entries of /proc/self/fd.
nlohmann::json usage() {
  nlohmann::json u;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) u["rss_kb"] = std::stol(line.substr(6));
    if (line.rfind("Threads:", 0) == 0) u["threads"] = std::stol(line.substr(8));
  }
  int fds = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++fds;
  u["fds"] = fds - 1;  // the iterator's own
  return u;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GradSync construction/destruction churn"};
  int iterations = 1000, warmup = 20;
  std::string codec = "none";
  app.add_option("--iterations", iterations);
  app.add_option("--warmup", warmup, "iterations before the first measurement");
  app.add_option("--codec", codec);
  CLI11_PARSE(app, argc, argv);

  auto pg = ddpx::comm::init_from_env();
  torch::manual_seed(1);
  torch::nn::Sequential model(torch::nn::Linear(64, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 10));
  const auto x = torch::randn({8, 64});
  nlohmann::json out{{"iterations", iterations}, {"codec", codec}};
  for (int i = 0; i < iterations; ++i) {
    if (i == warmup) out["after_warmup"] = usage();
    ddpx::GradSync sync(model->named_parameters(), pg, ddpx::GradSyncOptions().codec(codec));
    model->zero_grad();
    model->forward(x).sum().backward();
  }
  out["end"] = usage();
  if (pg->getRank() == 0) std::cout << out.dump() << std::endl;
  return 0;
}
