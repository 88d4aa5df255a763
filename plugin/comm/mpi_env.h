#pragma once
// Process-wide MPI lifetime for the ddpx_mpi backend.
//
// MPI may be initialised once per process: the first backend initialises it at
// the highest thread level the library offers, and an exit handler finalises
// it. A backend whose collective timed out leaves a thread blocked inside MPI;
// MPI_Finalize would then hang, so the exit handler calls MPI_Abort instead,
// which also ends the stuck peers (a frozen rank cannot stall the job forever).
#include <mpi.h>

#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace ddpx::comm::detail {

class MpiEnv {
 public:
  // Initialises MPI on first use (thread-safe); throws if MPI cannot start.
  static MpiEnv& get();

  int thread_level() const { return thread_level_; }
  // True when several threads may call MPI at once (one worker per backend);
  // otherwise all backends share one worker thread.
  bool multiple() const { return thread_level_ >= MPI_THREAD_MULTIPLE; }
  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }

  // A collective failed or timed out: exit with MPI_Abort, never MPI_Finalize.
  void mark_broken(const std::string& why);
  bool broken() const;
  // Why (the first failure's message), "" while not broken.
  std::string broken_why() const;
  // Shrink (comm::shrink_group): ranks were lost and the survivors agreed
  // on a new group. The failure stops counting against new calls, and every
  // call posted before (on the old communicators, waiting on the lost ranks)
  // is abandoned: await_request throws once the epoch has moved on.
  void recover();
  uint64_t epoch() const;
  // The job finished, but some of its ranks never will (a frozen worker the
  // parameter server dropped): end them with MPI_Abort(code 0) at exit
  // instead of MPI_Finalize, whose fence would wait for them. Call it on one
  // rank, after its results are out.
  void end_job_at_exit(const std::string& why);

  // Called at exit before MPI_Finalize: each worker registers a function that
  // stops it and returns false if it could not (a thread stuck inside MPI).
  void on_shutdown(std::function<bool()> fn);

 private:
  MpiEnv();
  static void at_exit();

  int thread_level_ = MPI_THREAD_SINGLE;
  int world_rank_ = 0;
  int world_size_ = 1;
  bool we_initialised_ = false;
  mutable std::mutex mu_;
  std::string broken_why_;
  uint64_t epoch_ = 0;
  std::string end_why_;
  std::vector<std::function<bool()>> shutdown_;
};

// True when this process was started by an MPI launcher (mpirun / srun).
bool launched_by_mpi();

// Throws c10::DistBackendError carrying file:line and MPI's own error string.
[[noreturn]] void throw_mpi_error(int rc, const char* call, const char* file, int line);

}  // namespace ddpx::comm::detail

#define DDPX_MPI_CHECK(call)                                                      \
  do {                                                                            \
    int ddpx_rc_ = (call);                                                        \
    if (ddpx_rc_ != MPI_SUCCESS)                                                  \
      ::ddpx::comm::detail::throw_mpi_error(ddpx_rc_, #call, __FILE__, __LINE__); \
  } while (0)
