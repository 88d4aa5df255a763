#pragma once
// A worker's liveness signal (step 6 of the protocol in ddpx/ps.h): a thread
// of its own sends a HEARTBEAT to every server each timeout/4, so a long step
// is never mistaken for a dead worker. Not to this rank's own server
// (colocated): that one shares the process.
#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace ddpx::ps::detail {

class Heartbeat {
 public:
  // skip: the server rank not to send to (-1: none).
  Heartbeat(MPI_Comm comm, int worker, int servers, int skip, double timeout_s);
  ~Heartbeat() { stop(); }
  void stop();

 private:
  void loop();

  MPI_Comm comm_;
  int worker_, servers_, skip_;
  std::chrono::duration<double> period_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ddpx::ps::detail
