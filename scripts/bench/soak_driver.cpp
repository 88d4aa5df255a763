// ddpx-bench-soak: builds and destroys GradSync --iterations times over one
// model in one process, a synced backward each time, and prints (rank 0) the
// process's resident memory, threads and open descriptors after the warm-up
// and at the end, as one JSON line for scripts/bench/soak. Run under mpirun.
#include <ddpx/comm.h>
#include <ddpx/grad_sync.h>
#include <dirent.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

namespace {

// VmRSS (KiB) and Threads of this process, from /proc/self/status.
std::pair<int64_t, int64_t> rss_and_threads() {
  std::ifstream f("/proc/self/status");
  std::string key;
  int64_t rss = -1, threads = -1;
  while (f >> key) {
    if (key == "VmRSS:") f >> rss;
    if (key == "Threads:") f >> threads;
    f.ignore(1 << 20, '\n');
  }
  return {rss, threads};
}

int64_t open_fds() {
  int64_t n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
    n -= 3;  // ".", ".." and the descriptor of the listing itself
  }
  return n;
}

nlohmann::json sample() {
  const auto [rss, threads] = rss_and_threads();
  return {{"rss_kib", rss}, {"threads", threads}, {"fds", open_fds()}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GradSync constructions and destructions in one process (scripts/bench/soak)"};
  int iterations = 1000, warmup = 100;
  app.add_option("--iterations", iterations)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--warmup", warmup, "iterations before the first sample")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  auto pg = ddpx::comm::init_from_env();
  torch::manual_seed(1);
  torch::nn::Sequential model(torch::nn::Linear(64, 256), torch::nn::ReLU(),
                              torch::nn::Linear(256, 256), torch::nn::ReLU(),
                              torch::nn::Linear(256, 10));
  const auto x = torch::randn({32, 64});
  nlohmann::json out{{"iterations", iterations}, {"warmup", warmup}};
  for (int i = 0; i < iterations; ++i) {
    if (i == warmup) out["after_warmup"] = sample();
    ddpx::GradSync sync(model->named_parameters(), pg,
                        ddpx::GradSyncOptions().bucket_cap_mb(0.1).first_bucket_mb(0.05));
    model->zero_grad();
    model->forward(x).pow(2).mean().backward();
  }
  out["end"] = sample();
  if (pg->getRank() == 0) std::cout << out.dump() << std::endl;
  return 0;
}
