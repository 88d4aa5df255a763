#pragma once
// "This reduction has started its last collective": how a job on a channel
// thread (hooks/channel.h) lets the next job on the same process group start
// its own collectives while it waits for the wire. A process group pairs
// collectives by the order they are started, so two reductions may overlap
// only if every rank starts all of the first's before any of the second's;
// the job that knows that moment (allreduce_sum, after its last chunk's
// start) says so here, and the channel holds the next job until then.
//
// Cost when nobody listens: one thread-local load and one branch.
#include <functional>

namespace ddpx::comm::detail {

// Installs `notice` as this thread's listener (nullptr: none); returns the
// previous one so scopes nest. The listener is called at most once: the
// first notify_last_issue clears it.
std::function<void()>* set_issue_notice(std::function<void()>* notice);

// Tells this thread's listener, if any, that the running reduction will
// start no more collectives (a no-op with none installed).
void notify_last_issue();

}  // namespace ddpx::comm::detail
