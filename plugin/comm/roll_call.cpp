// ddpx::comm::roll_call: naming the rank behind a failed collective of a
// store-based group (Gloo, NCCL). Gloo's own timeout says only that a
// transfer timed out; which peer stopped is known to nobody. But the ranks
// share a store: every rank that saw the failure checks in there, and a
// rank that never does is the frozen, dead or cut-off one.
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "ddpx/comm.h"
#include "plugin/comm/peer_report.h"

namespace ddpx::comm {
namespace {

// A store no other process can reach: asking it names nobody.
bool process_local(const c10::intrusive_ptr<c10d::Store>& store) {
  c10::intrusive_ptr<c10d::Store> s = store;
  if (auto* prefix = dynamic_cast<c10d::PrefixStore*>(s.get())) s = prefix->getUnderlyingNonPrefixStore();
  return dynamic_cast<c10d::HashStore*>(s.get()) != nullptr;
}

// The n-th roll call of this process on a group: survivors of one failure
// each make their n-th call for it, so they meet under the same keys.
int next_round(const std::string& group) {
  static std::mutex mu;
  static std::map<std::string, int> rounds;
  std::lock_guard<std::mutex> lock(mu);
  return rounds[group]++;
}

std::chrono::milliseconds group_timeout(c10d::ProcessGroup& pg) {
  try {
    return pg.getDefaultBackend()->getBackendOptions()->timeout;
  } catch (const std::exception&) {  // a backend without options (ddpx_mpi)
    return default_timeout();
  }
}

struct Answers {
  std::vector<int64_t> seq;  // per rank; meaningless where !seen
  std::vector<char> seen;
};

// Checks in as `rank` with `seq`, then polls for the other ranks' check-ins
// until all have come or `grace` has passed.
Answers ask(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix, int rank,
            int size, int64_t seq, std::chrono::milliseconds grace) {
  auto key = [&prefix](int r) { return prefix + std::to_string(r); };
  const std::string mine = std::to_string(seq);
  store->set(key(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  Answers a{std::vector<int64_t>(size, 0), std::vector<char>(size, 0)};
  a.seen[rank] = 1;
  a.seq[rank] = seq;
  const auto deadline = std::chrono::steady_clock::now() + grace;
  for (;;) {
    int missing = 0;
    for (int r = 0; r < size; ++r) {
      if (a.seen[r]) continue;
      if (store->check({key(r)})) {
        const auto v = store->get(key(r));
        a.seq[r] = std::stoll(std::string(v.begin(), v.end()));
        a.seen[r] = 1;
      } else {
        ++missing;
      }
    }
    if (missing == 0 || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Leave together: the store may live in one of these processes (rank 0's,
  // under mpirun), which would otherwise go on to exit -- the job is failing
  // -- while the others still read. Each counts itself done, then waits (up
  // to a second) for every rank that checked in to be done too. The answers
  // are in hand: a store lost now changes nothing.
  try {
    const std::string done = prefix + "done";
    int64_t seen = 0;
    for (char s : a.seen) seen += s;
    store->add(done, 1);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (store->add(done, 0) < seen && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  } catch (const std::exception&) {
  }
  return a;
}

}  // namespace

std::string roll_call(c10d::ProcessGroup& pg, int64_t seq, std::chrono::milliseconds grace) {
  const int rank = pg.getRank(), size = pg.getSize();
  auto store = pg.getStore();
  if (size < 2 || !store || process_local(store)) return "";
  if (grace.count() <= 0) {
    grace = std::clamp(group_timeout(pg) / 2, std::chrono::milliseconds(1000),
                       std::chrono::milliseconds(10000));
  }
  const std::string prefix =
      "ddpx_roll_call/" + std::to_string(next_round(pg.getGroupName())) + "/";
  // On its own thread: if the process serving the store is the one stopped,
  // a store call blocks for the store's whole timeout; we wait a bounded time
  // and leave that thread behind (the job is failing anyway).
  auto done = std::make_shared<std::promise<Answers>>();
  auto answers = done->get_future();
  // It drops its reference to the store before it answers, so the caller
  // (who may destroy the group next) always holds the last one.
  std::thread([done, store, prefix, rank, size, seq, grace]() mutable {
    try {
      Answers a = ask(store, prefix, rank, size, seq, grace);
      store.reset();
      done->set_value(std::move(a));
    } catch (...) {
      store.reset();
      done->set_exception(std::current_exception());
    }
  }).detach();
  const auto bound = grace + std::chrono::milliseconds(2000);
  if (answers.wait_for(bound) != std::future_status::ready) {
    return "the group's store did not answer within " + std::to_string(bound.count()) +
           " ms either: the process serving it (rank 0, or the launcher's agent) may be the one "
           "stopped";
  }
  Answers a;
  try {
    a = answers.get();
  } catch (const std::exception& e) {
    return std::string("the group's store failed too (") + e.what() +
           "): the process serving it (rank 0, or the launcher's agent) may be the one lost";
  }
  std::vector<int> silent, elsewhere;
  for (int r = 0; r < size; ++r) {
    if (!a.seen[r]) {
      silent.push_back(r);
    } else if (a.seq[r] != seq) {
      elsewhere.push_back(r);
    }
  }
  return detail::peer_report(silent, elsewhere, grace,
                             "stopped, dead, cut off, or still blocked in another call",
                             "failed at a different point (" + std::to_string(seq) +
                                 " here): the ranks did not make the same calls");
}

}  // namespace ddpx::comm
