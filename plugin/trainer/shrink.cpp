#include "plugin/trainer/shrink.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <functional>
#include <iostream>

namespace ddpx::trainer {
void check_shrink_options(const Options& o, int world) {
  if (o.on_rank_loss != "shrink") return;
  TORCH_CHECK(comm::detect_launcher() == comm::Launcher::Mpi,
              "ddpx-train: --on-rank-loss shrink works under mpirun (ddpx-run); under torchrun "
              "use its elastic restarts (--nnodes MIN:MAX with --checkpoint)");
  TORCH_CHECK(comm::mpi_recovery_mode(),
              "ddpx-train: --on-rank-loss shrink needs mpirun's recovery mode (mpirun --mca "
              "orte_enable_recovery 1, as ddpx-run runs it): without it Open MPI ends every "
              "rank when one dies");
  TORCH_CHECK(o.global_batch > 0,
              "ddpx-train: --on-rank-loss shrink needs --global-batch (the survivors re-slice "
              "the same global batches)");
  TORCH_CHECK(o.overlap == "none" && o.staleness == 0,
              "ddpx-train: --on-rank-loss shrink needs --overlap none and --staleness 0 (an "
              "update applied bucket by bucket may be half done when a rank is lost)");
  TORCH_CHECK(o.channels == 1, "ddpx-train: --on-rank-loss shrink works with --channels 1");
  TORCH_CHECK(world >= o.min_ranks, "ddpx-train: --min-ranks ", o.min_ranks, " but the job has ",
              world, " rank(s)");
}

int64_t host_hash() {
  char name[256] = {0};
  gethostname(name, sizeof name - 1);
  return static_cast<int64_t>(std::hash<std::string>()(name) >> 1);
}

Procs gather_procs(c10d::ProcessGroup& pg) {
  std::vector<at::Tensor> in{at::tensor({host_hash(), static_cast<int64_t>(getpid())}, at::kLong)};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < pg.getSize(); ++r) out[0].push_back(at::empty({2}, at::kLong));
  pg.allgather(out, in)->wait();
  Procs p;
  for (const auto& t : out[0]) {
    p.host.push_back(t[0].item<int64_t>());
    p.pid.push_back(t[1].item<int64_t>());
  }
  return p;
}

Shrunk shrink_after_loss(const Options& o, const std::string& why, std::vector<int>& members,
                         int64_t progress, std::chrono::milliseconds timeout, const Procs& procs) {
  const auto t0 = std::chrono::steady_clock::now();
  std::cerr << "[ddpx-train] " << comm::process_label() << ": after step " << progress << ": "
            << why.substr(0, why.find('\n')) << "; agreeing with ranks [" << c10::Join(" ", members)
            << "] on who is left" << std::endl;
  // The window: every survivor fails the collective the lost rank never
  // joined within one timeout of the first (a rank that got its result
  // fails the next step's).
  const comm::Survivors s = comm::agree_on_survivors(members, progress, timeout);
  TORCH_CHECK(static_cast<int>(s.world_ranks.size()) >= o.min_ranks, "ddpx-train: lost rank(s) [",
              c10::Join(" ", s.lost), "]; ", s.world_ranks.size(), " left ([",
              c10::Join(" ", s.world_ranks), "]), fewer than --min-ranks ", o.min_ranks);
  TORCH_CHECK(!s.lost.empty(), "ddpx-train: step ", progress + 1,
              " failed but every rank still answers (", why.substr(0, why.find('\n')),
              "): not a lost rank, so no shrink");
  // A lost rank on this host is ended here: frozen (SIGSTOP, a hung
  // driver), it would hold mpirun for ever and could wake to report a
  // failure of a job that went on without it. (On another host, mpirun's
  // end of the job at exit is all there is.)
  // (Test hook DDPX_TRAIN_KEEP_LOST=1: as if every lost rank ran on another
  // host, where ddpx-run's --linger-s is what ends the job.)
  const bool keep = std::getenv("DDPX_TRAIN_KEEP_LOST") != nullptr;
  const int64_t here = host_hash();
  for (int r : keep ? std::vector<int>{} : s.lost) {
    if (procs.host.at(r) == here && procs.pid.at(r) != getpid()) {
      ::kill(static_cast<pid_t>(procs.pid.at(r)), SIGKILL);
    }
  }
  Shrunk out;
  out.lost = s.lost;
  // The most advanced survivor: a rank that got the last collective's result
  // before the loss applied that step; the others take its state.
  const auto best = std::max_element(s.progress.begin(), s.progress.end());
  out.leader = static_cast<int>(best - s.progress.begin());
  out.pg = comm::shrink_group(s, timeout);
  members = s.world_ranks;
  out.agree_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace ddpx::trainer
