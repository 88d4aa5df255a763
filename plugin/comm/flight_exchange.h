#pragma once
// The one-screen diagnosis of a failed job, from every reachable rank's
// flight recorder (flight_recorder.h), gathered over the job's store: the
// collective path is what broke, and a rank stuck outside ddpx (in its data
// loader, say) still has a thread that can answer. ddpx-train's.
//
// Protocol (keys under "ddpx_fr/"):
//  1. Every rank runs a responder thread that looks for "ask" every 100 ms
//     and, once it is there, writes its recorder to "buf/<rank>" (once).
//  2. A rank whose step failed writes its own buffer, sets "ask", and waits
//     up to `grace` for every rank's buffer.
//  3. The first rank to claim "reporter" analyses what came (flight_report.h)
//     and returns the screen; the others return "". A rank whose buffer never
//     came is reported as not answering (stopped, dead, or its process cannot
//     reach the store).
// Every store call runs off the caller's thread with a bounded wait: the
// process serving the store (rank 0 under mpirun) may be the one stopped.
#include <chrono>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace ddpx::comm::detail {

class FrExchange {
 public:
  // `store` reaches every rank of `world`; nothing is started when the
  // recorder is off.
  FrExchange(c10::intrusive_ptr<c10d::Store> store, int rank, int world);
  ~FrExchange();
  FrExchange(const FrExchange&) = delete;
  FrExchange& operator=(const FrExchange&) = delete;

  // The job's store for `pg`'s ranks: pg's own under torchrun (Gloo's);
  // under mpirun (ddpx_mpi has none) one rank 0 serves (collective).
  static c10::intrusive_ptr<c10d::Store> job_store(c10d::ProcessGroup& pg,
                                                   std::chrono::milliseconds timeout);

  // Steps 2-3: the screen, or "" (another rank reports, or the recorder is
  // off). Never throws; bounded by grace + 2 s.
  std::string diagnose(std::chrono::milliseconds grace);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace ddpx::comm::detail
