// ddpx-train's checkpoint reader (restore_checkpoint, behind --resume): any
// bytes as the file, restored into a small model, its SGD optimizer (with
// momentum state) and a one-rank GradSync -- the objects a real resume fills.
#include <torch/optim/sgd.h>

#include "ddpx/comm.h"
#include "plugin/trainer/checkpoint.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace ddpx::trainer;

struct Run {
  torch::jit::Module model{"Fuzz"};
  std::unique_ptr<torch::optim::SGD> optimizer;
  std::unique_ptr<ddpx::GradSync> sync;
  ddpx::comm::ProcessGroupPtr pg = ddpx::comm::init_from_env();

  Run() {
    model.register_parameter("w", at::randn({3, 2}), /*is_buffer=*/false);
    model.register_parameter("b", at::zeros({3}), /*is_buffer=*/false);
    model.register_buffer("count", at::zeros({1}, at::kLong));
    std::vector<at::Tensor> params;
    for (const auto& p : model.parameters()) params.push_back(p);
    optimizer =
        std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    sync = std::make_unique<ddpx::GradSync>(model, pg);
  }
  TrainObjects objects() { return {model, *optimizer, "sgd", *sync}; }
};

Run& run() {
  static Run r;
  return r;
}

// A checkpoint of these objects after one step (momentum buffers exist).
void write_seed() {
  Run& r = run();
  for (const auto& p : r.model.parameters()) p.mutable_grad() = at::ones_like(p);
  r.optimizer->step();
  const std::string path = std::string(ddpx::fuzz::seed_dir()) + "/step1.ckpt";
  std::filesystem::create_directories(ddpx::fuzz::seed_dir());
  auto t = r.objects();
  save_checkpoint(path, *r.pg, t, Position{1, 0, 1});
}

}  // namespace

// No allowance for large allocations: the archive is bounded by its own bytes
// before torch reads it (plugin/archive_check), so one the size of a mutated
// length field is a finding (libFuzzer's default malloc limit).
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (ddpx::fuzz::seed_dir()) {
    write_seed();
    std::exit(0);
  }
  run();  // construct once, outside the timed inputs
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto t = run().objects();
  Position pos;
  ddpx::fuzz::expect_ok_or_error(
      [&] { restore_checkpoint(reinterpret_cast<const char*>(data), size, "fuzz", t, pos); });
  return 0;
}
