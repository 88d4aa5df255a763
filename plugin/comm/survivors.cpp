// comm::agree_on_survivors and comm::shrink_group (comm.h): after ranks were
// lost, the ranks still running agree on who is left and make a group of
// their own, without ULFM. Only point-to-point messages on MPI_COMM_WORLD with
// tags of their own (nothing else in ddpx sends on WORLD itself), each round
// bounded by the window: a collective would wait for the lost ranks forever.
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <ddpx/comm.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "plugin/comm/mpi_backend.h"
#include "plugin/comm/mpi_env.h"

namespace ddpx::comm {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kTagBase = 0x5d7100;  // + 4 * agreement + round
constexpr int64_t kAbsent = -1;     // "not heard from" in a view

// One round: sends `mine` (world-size int64s) to each rank of `to`, and waits
// until every rank of `from` has sent its own, or the deadline. Returns each
// sender's message (empty where none came). Unanswered receives are
// cancelled; sends to a lost rank are left to MPI (small: eager).
std::vector<std::vector<int64_t>> exchange(const std::vector<int64_t>& mine,
                                           const std::vector<int>& to, const std::vector<int>& from,
                                           int tag, Clock::time_point deadline) {
  const int me = detail::MpiEnv::get().world_rank();
  const int n = static_cast<int>(mine.size());
  std::vector<std::vector<int64_t>> got(n);
  std::vector<MPI_Request> sends, recvs;
  std::vector<int> recv_from;
  const auto payload = std::make_shared<const std::vector<int64_t>>(mine);
  for (int r : to) {
    if (r == me) continue;
    MPI_Request q;
    DDPX_MPI_CHECK(MPI_Isend(payload->data(), n, MPI_INT64_T, r, tag, MPI_COMM_WORLD, &q));
    sends.push_back(q);
  }
  for (int r : from) {
    if (r == me) continue;
    got[r].assign(n, kAbsent);
    MPI_Request q;
    DDPX_MPI_CHECK(MPI_Irecv(got[r].data(), n, MPI_INT64_T, r, tag, MPI_COMM_WORLD, &q));
    recvs.push_back(q);
    recv_from.push_back(r);
  }
  std::vector<bool> done(recvs.size(), false);
  size_t left = recvs.size();
  while (left > 0 && Clock::now() < deadline) {
    for (size_t i = 0; i < recvs.size(); ++i) {
      if (done[i]) continue;
      int flag = 0;
      DDPX_MPI_CHECK(MPI_Test(&recvs[i], &flag, MPI_STATUS_IGNORE));
      if (flag) {
        done[i] = true;
        --left;
      }
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    if (done[i]) continue;
    // A receive's cancel completes locally: after the wait MPI writes no
    // more into the buffer. A message that matched first still counts.
    MPI_Status st;
    MPI_Cancel(&recvs[i]);
    MPI_Wait(&recvs[i], &st);
    int cancelled = 0;
    MPI_Test_cancelled(&st, &cancelled);
    if (cancelled) got[recv_from[i]].clear();
  }
  // A send to a lost rank may never complete, and MPI may still read its
  // buffer: those buffers live as long as the process (a few bytes each).
  static std::mutex mu;
  static std::deque<std::shared_ptr<const std::vector<int64_t>>> unsent;
  for (auto& q : sends) {
    int flag = 0;
    MPI_Test(&q, &flag, MPI_STATUS_IGNORE);
    if (flag) continue;
    MPI_Request_free(&q);
    std::lock_guard<std::mutex> lock(mu);
    unsent.push_back(payload);
  }
  got[me] = mine;
  return got;
}

}  // namespace

Survivors agree_on_survivors(const std::vector<int>& members, int64_t progress,
                             std::chrono::milliseconds window) {
  auto& env = detail::MpiEnv::get();
  const int me = env.world_rank(), n = env.world_size();
  TORCH_CHECK(progress >= 0, "agree_on_survivors: progress must be >= 0, got ", progress);
  TORCH_CHECK(std::find(members.begin(), members.end(), me) != members.end(),
              "agree_on_survivors: members must include this rank (", me, "), got [",
              c10::Join(" ", members), "]");
  for (int r : members) {
    TORCH_CHECK(r >= 0 && r < n, "agree_on_survivors: members entry ", r,
                " is not a world rank (world size ", n, ")");
  }
  TORCH_CHECK(env.multiple(),
              "agree_on_survivors needs MPI_THREAD_MULTIPLE (a communication thread may be "
              "inside MPI still); this MPI offers level ",
              env.thread_level());
  // Every survivor makes the same sequence of agreements, so their tags match.
  static int agreements = 0;
  const int tag = kTagBase + 4 * (agreements++ % 1024);

  // 1. Who answers: each member's progress, heard within the window.
  std::vector<int64_t> view(n, kAbsent);
  view[me] = progress;
  auto heard = exchange(view, members, members, tag, Clock::now() + window);
  std::vector<int> alive;
  for (int r : members) {
    if (!heard[r].empty()) {
      view[r] = heard[r][r];
      alive.push_back(r);
    }
  }
  // 2. What each of them heard: keep the ranks every answer names.
  auto views = exchange(view, alive, alive, tag + 1, Clock::now() + window);
  std::vector<int64_t> agreed = view;
  for (int r : alive) {
    if (views[r].empty()) {  // it went quiet since
      agreed[r] = kAbsent;
      continue;
    }
    for (int q = 0; q < n; ++q) {
      if (views[r][q] == kAbsent) agreed[q] = kAbsent;
    }
  }
  TORCH_CHECK(agreed[me] != kAbsent, "agree_on_survivors: the other ranks left rank ", me,
              " out (they did not hear from it in time); it cannot go on with them");
  std::vector<int> kept;
  for (int q = 0; q < n; ++q) {
    if (agreed[q] != kAbsent) kept.push_back(q);
  }
  // 3. Everyone kept the same ranks, or nobody goes on.
  auto check = exchange(agreed, kept, kept, tag + 2, Clock::now() + window);
  for (int r : kept) {
    TORCH_CHECK(!check[r].empty(), "agree_on_survivors: rank ", r,
                " stopped answering while the survivors [", c10::Join(" ", kept), "] agreed");
    TORCH_CHECK(check[r] == agreed, "agree_on_survivors: rank ", r,
                " kept other ranks than this one ([", c10::Join(" ", kept),
                "]): the survivors disagree, so none can go on");
  }
  Survivors s;
  s.world_ranks = kept;
  for (int r : kept) s.progress.push_back(agreed[r]);
  for (int r : members) {
    if (agreed[r] == kAbsent) s.lost.push_back(r);
  }
  return s;
}

ProcessGroupPtr shrink_group(const Survivors& s, std::chrono::milliseconds timeout) {
  const int me = detail::MpiEnv::get().world_rank();
  const auto it = std::find(s.world_ranks.begin(), s.world_ranks.end(), me);
  TORCH_CHECK(it != s.world_ranks.end(), "shrink_group: this rank (", me,
              ") is not among the survivors [", c10::Join(" ", s.world_ranks), "]");
  // Calls posted on the old groups wait on the lost ranks: abandon them.
  detail::MpiEnv::get().recover();
  BackendPtr be = detail::MpiBackend::create(s.world_ranks, timeout);
  const int rank = static_cast<int>(it - s.world_ranks.begin());
  const int size = static_cast<int>(s.world_ranks.size());
  auto pg =
      c10::make_intrusive<c10d::ProcessGroup>(c10::make_intrusive<c10d::HashStore>(), rank, size);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, be);
  pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::CUSTOM, be);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  pg->setGroupName("shrunk" + std::to_string(detail::MpiEnv::get().epoch()));
  // MPI_Finalize would wait for the lost ranks (a frozen one for ever).
  if (rank == 0) detail::MpiEnv::get().end_job_at_exit("ranks lost: " + c10::Join(" ", s.lost));
  return pg;
}

bool mpi_recovery_mode() {
  const char* v = std::getenv("OMPI_MCA_orte_enable_recovery");
  return v != nullptr && (std::string(v) == "1" || std::string(v) == "true");
}

}  // namespace ddpx::comm
