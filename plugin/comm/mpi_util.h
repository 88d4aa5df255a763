#pragma once
// Small pieces shared by the ddpx_mpi collectives: staging tensors in host
// memory, the cross-rank agreement check, and argument checks at the door.
#include <ATen/ATen.h>
#include <mpi.h>

#include <climits>
#include <initializer_list>
#include <string>
#include <vector>

namespace ddpx::comm::detail {

// What a buffer is for: MPI takes device memory in more of the one than the
// other (mpi_takes_cuda_memory).
enum class Transfer { kCollective, kPointToPoint };

// A contiguous buffer for MPI: the tensor itself when it is a contiguous CPU
// tensor (or a CUDA one that MPI takes for this kind of transfer), else a
// staged copy in host memory, pinned for a CUDA tensor (Open MPI from Debian
// is not CUDA-aware). Runs on the worker, under the caller's stream, so the
// copy is ordered after the producer; the copies are complete when the calls
// return.
class HostView {
 public:
  HostView(const at::Tensor& t, bool copy_in, Transfer kind = Transfer::kCollective);
  void* ptr() const { return host_.data_ptr(); }
  int count() const { return static_cast<int>(host_.numel()); }
  const at::Tensor& host() const { return host_; }
  void write_back() const;

 private:
  at::Tensor user_;
  at::Tensor host_;
};

// Whether MPI is handed CUDA device memory for a kind of transfer.
// Point-to-point: where the library is CUDA-aware (Open MPI's
// MPIX_Query_cuda_support; Debian's is not). Collectives: only when
// DDPX_MPI_CUDA_AWARE=1 says so as well: ddpx_mpi's collectives are
// non-blocking, and Open MPI's CUDA support covers sends, receives and the
// blocking collectives only (its FAQ, "Which MPI APIs work with
// CUDA-aware?"), so by default they are staged through host memory.
// DDPX_MPI_CUDA_AWARE=0: never.
bool mpi_takes_cuda_memory(Transfer kind);
struct CudaMemoryPolicy {
  bool point_to_point = false;
  bool collectives = false;
};
// The rule above, for DDPX_MPI_CUDA_AWARE's value (null: unset) and the
// library's answer; any other value is an error naming the variable.
CudaMemoryPolicy cuda_memory_policy(const char* env, bool library_aware);

// A tensor's dtype as one field of check_agreement's fingerprint.
inline int64_t dtype_id(const at::Tensor& t) { return static_cast<int64_t>(t.scalar_type()); }

// Every rank must call a collective with matching sizes, dtypes, op and root.
// MPI would read or write out of bounds otherwise, so one tiny allreduce of a
// fingerprint (and its negation, with MAX) detects any disagreement first.
void check_agreement(MPI_Comm comm, std::initializer_list<int64_t> fingerprint,
                     const std::string& what, const std::string& local_desc);

// Completes a nonblocking MPI call on the worker thread without spinning
// longer than pays. A blocking collective busy-polls inside Open MPI for as
// long as the bytes take, which on a network link steals a core from the
// backward it is meant to overlap; this tests the request and naps as
// WaitPacer says (wait_pacer.h). Throws once MPI is marked broken (a Work
// timed out), so a lost peer does not hold the worker forever.
//
// `memory`: all that the call reads or writes until it completes (its
// buffers; a v-collective's count arrays: int_array). A call abandoned here
// stays posted: MPI_Cancel and MPI_Request_free are erroneous on a
// collective's request, and a stalled peer that resumes, or the library
// progressing the old communicator after a shrink, may still complete it and
// write that memory. So the request and its memory are kept until a later
// await_request finds the request complete; the caller's references may go.
void await_request(MPI_Request& request, c10::ArrayRef<at::Tensor> memory);
// The same for calls in flight together (Open MPI progresses all of them
// while testing any); abandoned, they are kept as one with `memory`, until
// every one has completed.
void await_requests(std::vector<MPI_Request>& requests, c10::ArrayRef<at::Tensor> memory);
// Keeps `memory` until every one of `requests` (posted, never awaited: an
// error came between) has completed.
void keep_until_complete(const std::vector<MPI_Request>& requests,
                         c10::ArrayRef<at::Tensor> memory);

// Bytes of abandoned calls' memory kept now (see await_request).
int64_t abandoned_call_bytes();

// Counts or displacements for a nonblocking v-collective, in memory that
// await_request can keep (a CPU int32 tensor; ints() is its data).
at::Tensor int_array(const std::vector<int>& values);
inline int* ints(const at::Tensor& array) { return array.data_ptr<int>(); }

// Checks at the door (caller's thread); each names the argument.
// The ranks of `comm`'s members in `parent`, in `comm`'s rank order.
std::vector<int> ranks_in_parent(MPI_Comm comm, MPI_Comm parent);

void check_dense(const at::Tensor& t, const char* arg);
void check_single(const std::vector<at::Tensor>& tensors, const char* arg);
void check_same_dtype_numel(const at::Tensor& t, const at::Tensor& ref, const char* arg);
void check_rank(int64_t rank, int size, const char* arg);
int to_count(int64_t numel, const char* arg);

// "1024 x float" style description for messages.
std::string describe(const at::Tensor& t);

}  // namespace ddpx::comm::detail
