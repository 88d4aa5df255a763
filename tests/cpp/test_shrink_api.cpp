// The C++ API a trainer uses to go on without a lost rank (comm.h:
// agree_on_survivors, shrink_group; grad_sync.h: state / load_state), as
// comm.h's recipe says, on 3 ranks under mpirun's recovery mode. Two synced
// steps; the last rank exits; the next step fails on the others at the
// timeout; they agree (survivors 0 and 1, both at step 2), make their group,
// build a new GradSync with the old state, redo the step, and its averaged
// gradient is the mean of the two survivors' own gradients. Rank 0 prints
// "shrink-ok" only when both survivors checked everything (ctest matches it;
// the job's exit code is mpirun's and does not count).
#include <ddpx/comm.h>
#include <ddpx/grad_sync.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>

namespace {

using ddpx::GradSync;
constexpr std::chrono::milliseconds kTimeout(2000);

// Rank r's batch for a step: inputs that differ per rank.
at::Tensor batch(int64_t step, int rank) {
  return at::full({4, 6}, 0.1 * double(rank + 1) + 0.01 * double(step));
}

at::Tensor local_grad(torch::nn::Linear& m, int64_t step, int rank) {
  torch::nn::Linear copy(6, 3);
  {
    torch::NoGradGuard g;
    copy->weight.copy_(m->weight);
    copy->bias.copy_(m->bias);
  }
  copy(batch(step, rank)).pow(2).sum().backward();
  return copy->weight.grad().clone();
}

bool check(bool ok, const char* what, int rank) {
  if (!ok) std::printf("shrink-FAILED rank %d: %s\n", rank, what);
  return ok;
}

}  // namespace

int main() {
  auto pg = ddpx::comm::init_from_env(kTimeout);
  const int world_rank = pg->getRank();
  TORCH_CHECK(pg->getSize() == 3, "test_shrink_api runs on 3 ranks");
  torch::manual_seed(0);
  torch::nn::Linear model(6, 3);
  torch::OrderedDict<std::string, at::Tensor> params;
  for (const auto& p : model->named_parameters()) params.insert(p.key(), p.value());
  auto sync = std::make_unique<GradSync>(params, pg);
  for (int64_t step = 0; step < 2; ++step) {
    model->zero_grad();
    model(batch(step, world_rank)).pow(2).sum().backward();
  }
  if (world_rank == 2) {
    std::fflush(stdout);
    _exit(0);  // lost: the others find out at the next step's timeout
  }
  bool ok = true;
  bool failed = false;
  try {
    model->zero_grad();
    model(batch(2, world_rank)).pow(2).sum().backward();
  } catch (const c10::Error& e) {
    failed = true;
  }
  ok &= check(failed, "the step after the loss did not fail", world_rank);
  const GradSync::State state = sync->state();
  sync.reset();
  const auto s = ddpx::comm::agree_on_survivors({0, 1, 2}, 2, kTimeout);
  ok &= check(s.world_ranks == std::vector<int>({0, 1}), "survivors are not [0 1]", world_rank);
  ok &= check(s.lost == std::vector<int>({2}), "lost is not [2]", world_rank);
  ok &= check(s.progress == std::vector<int64_t>({2, 2}), "progress is not [2 2]", world_rank);
  auto small = ddpx::comm::shrink_group(s, kTimeout);
  ok &= check(small->getSize() == 2 && small->getRank() == world_rank, "the new group's place",
              world_rank);
  sync = std::make_unique<GradSync>(params, small);
  sync->load_state(state);
  // The redone step: the mean of the survivors' gradients.
  const at::Tensor want = (local_grad(model, 2, 0) + local_grad(model, 2, 1)) / 2;
  model->zero_grad();
  model(batch(2, world_rank)).pow(2).sum().backward();
  ok &= check(at::allclose(model->weight.grad(), want, 1e-6, 1e-6),
              "the redone step's gradient is not the survivors' mean", world_rank);
  std::vector<at::Tensor> flag{at::tensor({ok ? 1.0 : 0.0})};
  small->allreduce(flag)->wait();
  if (world_rank == 0 && flag[0].item<double>() == 2.0) {
    std::printf("shrink-ok: ranks 0 and 1 went on without rank 2\n");
  }
  std::fflush(stdout);
  return 0;
}
