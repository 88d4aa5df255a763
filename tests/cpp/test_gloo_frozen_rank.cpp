// A stopped rank under Gloo: Gloo's timeout says a transfer timed out, not
// which peer stopped. GradSync then asks the ranks on the group's store
// (comm::roll_call), and its error names the silent one. Rank 1 stops
// answering after one healthy step (it sleeps far past the timeout, as a
// SIGSTOPped rank would); every other rank must fail its next step within
// the timeout plus the roll call's grace, naming rank 1 and no one else,
// and the collective it was waiting for (comm::detail::wait_named).
// ctest checks the survivors' lines ("frozen-ok", never "frozen-FAILED").
#include <ddpx/comm.h>
#include <ddpx/grad_sync.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <thread>

int main() {
  ddpx::comm::MakeOptions o;
  o.timeout = std::chrono::milliseconds(1500);
  o.name = "frozen_rank_test";
  auto pg = ddpx::comm::make("gloo", o);
  const int rank = pg->getRank();
  torch::nn::Linear lin(4, 2);
  ddpx::GradSync sync(lin->named_parameters(), pg);
  auto step = [&] {
    lin->zero_grad();
    lin(at::ones({3, 4})).sum().backward();
  };
  step();  // everyone is alive here
  if (rank == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return 0;
  }
  const auto t0 = std::chrono::steady_clock::now();
  try {
    step();
    std::printf("frozen-FAILED: rank %d's step completed without rank 1\n", rank);
    return 1;
  } catch (const c10::DistBackendError& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string msg = e.what_without_backtrace();
    // Rank 1 alone: with three ranks, rank 2 (or 0) checked in too.
    const bool named = msg.find("rank 1 of this group did not answer") != std::string::npos &&
                       msg.find("ranks ") == std::string::npos &&
                       msg.find("waiting for allreduce") != std::string::npos;
    std::printf("%s on rank %d after %.1f s: %s\n", named && s < 10 ? "frozen-ok" : "frozen-FAILED",
                rank, s, msg.c_str());
    std::fflush(stdout);
    // Give the other survivor time to print, then end the job (rank 1 too).
    std::this_thread::sleep_for(std::chrono::seconds(2));
    ddpx::comm::abort_job(2);
  }
}
