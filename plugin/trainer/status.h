#pragma once
// --status-file: the job's outcome where a shell can test it, whatever
// mpirun's exit code says (under Open MPI 4's recovery mode, which the
// parameter server's fault rules need, mpirun exits 0 even after
// MPI_Abort(1)). One line, replaced atomically (write_durably):
//   running                      rank 0 at start (a stale outcome is gone)
//   ok                           the lead rank, training and scoring done
//   ok, ranks lost: 2 3          the same, with ranks the servers dropped
//   failed: <rank>: <reason>     the first rank that ends the job with an error
//                                (a later one -- a peer left waiting, a frozen
//                                rank resumed by mpirun's teardown -- reports
//                                a consequence and keeps it)
// A job that ends still saying "running" died without a word (a rank killed
// with no survivor to notice, a signal): not a success. ddpx-run (next to
// ddpx-train) runs mpirun with --status-file and exits 0 only on "ok".
#include <string>

namespace ddpx::trainer {

class JobStatus {
 public:
  // Rank 0 (by the launcher's environment: OMPI_COMM_WORLD_RANK, RANK, or
  // none) writes "running"; path "" turns every write into nothing.
  explicit JobStatus(std::string path);
  void write(const std::string& line) const;
  // "failed: " + reason, unless the file already holds a failure. (Read,
  // then replace: two ranks failing within the same instant may both write;
  // failures seconds apart, as a timeout after a peer's, keep the first.)
  void fail(const std::string& reason) const;

 private:
  std::string path_;
};

}  // namespace ddpx::trainer
