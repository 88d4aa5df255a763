#pragma once
// The server's consistency gate (step 3 of the protocol in ddpx/ps.h): given
// the pushes that arrived, which to apply now, which to drop, which to hold.
// Pure bookkeeping, no MPI, so every mode is unit-tested on made-up orders.
#include <ddpx/ps.h>

#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

namespace ddpx::ps::detail {

struct Ticket {
  int worker = 0;
  int64_t seq = 0;
  int64_t base = 0;
  int64_t id = 0;  // the server's handle of the decoded gradient
};

// One update: the mean of `apply` (one ticket except under sync), and the
// pushes refused (sync: computed on an older version).
struct Decision {
  std::vector<Ticket> apply;
  std::vector<Ticket> drop;
};

class Gate {
 public:
  Gate(Consistency c, int workers, bool deterministic);

  void offer(const Ticket& t);
  // The server sent `worker` the parameters of `version`: the base of the
  // gradient it computes next.
  void gave(int worker, int64_t version);
  // BYE or dropped: the worker sends nothing more and bounds nobody.
  void gone(int worker);
  // One more push of `worker` is done with (applied or dropped): its clock.
  void finished(int worker);
  // A restored server: `worker` had `n` pushes done with.
  void set_done(int worker, int64_t n) { done_[worker] = n; }
  // May `worker` be given parameters for its next step? Under ssp:S only
  // while its clock (pushes done with) is at most S ahead of the slowest
  // live worker's; the server holds the reply until then. Always otherwise.
  bool may_start(int worker) const;
  bool live(int worker) const { return live_[worker]; }
  int live_count() const;
  int64_t held() const;

  // What to do at `version` (the server's version before the update), or
  // nullopt when every held push must wait.
  std::optional<Decision> next(int64_t version);

 private:
  std::optional<Decision> next_async();
  std::optional<Decision> next_ssp(int64_t version);
  std::optional<Decision> next_sync(int64_t version);
  Decision take(size_t i);

  Consistency c_;
  bool deterministic_;
  std::vector<bool> live_;
  std::vector<int64_t> base_;  // [worker] base of the gradient it is computing
  std::vector<bool> given_;    // [worker] has had its first parameters
  std::vector<int64_t> done_;  // [worker] pushes applied or dropped (its clock)
  std::vector<bool> in_flight_;  // [worker] computing on parameters it was given, or held here
  std::deque<Ticket> held_;    // arrival order
  int cursor_ = 0;             // deterministic async: whose turn it is
};

}  // namespace ddpx::ps::detail
