#include "plugin/comm/mpi_util.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's extensions: MPIX_Query_cuda_support
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>

#include "plugin/comm/mpi_env.h"
#include "plugin/comm/wait_pacer.h"

namespace ddpx::comm::detail {

CudaMemoryPolicy cuda_memory_policy(const char* env, bool library_aware) {
  const std::string v = env == nullptr ? "" : env;
  TORCH_CHECK(v.empty() || v == "0" || v == "1",
              "DDPX_MPI_CUDA_AWARE must be 0 or 1 (or unset), got '", v, "'");
  if (v == "0") return {};
  return {library_aware, library_aware && v == "1"};
}

bool mpi_takes_cuda_memory(Transfer kind) {
  static const CudaMemoryPolicy policy = [] {
#if defined(MPIX_CUDA_AWARE_SUPPORT)
    const bool aware = MPIX_Query_cuda_support() == 1;
#else
    const bool aware = false;
#endif
    return cuda_memory_policy(std::getenv("DDPX_MPI_CUDA_AWARE"), aware);
  }();
  return kind == Transfer::kPointToPoint ? policy.point_to_point : policy.collectives;
}

namespace {

// Waits for the work queued on the calling thread's current stream of d.
void sync_current_stream(c10::Device d) {
  c10::impl::VirtualGuardImpl(d.type()).getStream(d).synchronize();
}

}  // namespace

HostView::HostView(const at::Tensor& t, bool copy_in, Transfer kind) : user_(t) {
  if (t.is_contiguous() && (t.is_cpu() || (t.is_cuda() && mpi_takes_cuda_memory(kind)))) {
    // A CUDA-aware MPI reads device memory itself but knows no streams: the
    // work that produced it must be done.
    if (t.is_cuda()) sync_current_stream(t.device());
    host_ = t;
    return;
  }
  // Pinned for CUDA: the copies run at the link's speed, without a bounce
  // through a driver buffer; synchronous still (the stream synchronized), so
  // the caller sees the result whichever stream it reads on.
  const bool pinned = t.is_cuda();
  host_ = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(pinned));
  if (copy_in) {
    host_.copy_(t, /*non_blocking=*/pinned);
    if (pinned) sync_current_stream(t.device());
  }
}

void HostView::write_back() const {
  if (host_.is_same(user_)) return;
  const bool pinned = user_.is_cuda();
  user_.copy_(host_, /*non_blocking=*/pinned);
  if (pinned) sync_current_stream(user_.device());
}

namespace {

// Abandoned calls (await_request) with the memory they may still write.
struct Abandoned {
  std::vector<MPI_Request> requests;
  std::vector<at::Tensor> memory;
};
std::mutex abandoned_mu;
std::atomic<int64_t> abandoned_count{0};
std::atomic<int64_t> abandoned_bytes{0};
// Leaked on purpose: MPI may write the memory until it finalises or aborts,
// after the exit-time destructors.
std::vector<Abandoned>& abandoned_calls() {
  static auto* calls = new std::vector<Abandoned>();
  return *calls;
}

int64_t bytes_of(const std::vector<at::Tensor>& memory) {
  int64_t n = 0;
  for (const auto& t : memory) n += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  return n;
}

void keep(const MPI_Request* requests, int n, c10::ArrayRef<at::Tensor> memory) {
  std::vector<MPI_Request> live;
  for (int i = 0; i < n; ++i) {
    if (requests[i] != MPI_REQUEST_NULL) live.push_back(requests[i]);
  }
  if (live.empty() || memory.empty()) return;
  Abandoned a{std::move(live), memory.vec()};
  const int64_t bytes = bytes_of(a.memory);
  std::lock_guard<std::mutex> lock(abandoned_mu);
  abandoned_calls().push_back(std::move(a));
  abandoned_count.fetch_add(1);
  abandoned_bytes.fetch_add(bytes);
}

// Lets go of the memory of abandoned calls that have completed since. One
// thread at a time tests them (a request is tested by one thread only).
void release_completed_abandoned() {
  if (abandoned_count.load(std::memory_order_relaxed) == 0) return;
  // At most every 100 ms: after a shrink, calls of the lost group may never
  // complete, and every later call would test them all.
  static std::atomic<int64_t> last_ns{0};
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  int64_t last = last_ns.load(std::memory_order_relaxed);
  if (now - last < int64_t{100'000'000} ||
      !last_ns.compare_exchange_strong(last, now, std::memory_order_relaxed)) {
    return;
  }
  std::lock_guard<std::mutex> lock(abandoned_mu);
  auto& calls = abandoned_calls();
  for (auto it = calls.begin(); it != calls.end();) {
    int done = 0;
    // An error (a communicator with lost ranks) leaves it kept.
    const int n = static_cast<int>(it->requests.size());
    if (MPI_Testall(n, it->requests.data(), &done, MPI_STATUSES_IGNORE) == MPI_SUCCESS && done) {
      abandoned_bytes.fetch_sub(bytes_of(it->memory));
      abandoned_count.fetch_sub(1);
      it = calls.erase(it);
    } else {
      ++it;
    }
  }
}

// Completes the calls of `requests`, or keeps them with `memory` and throws.
void await_all(MPI_Request* requests, int n, c10::ArrayRef<at::Tensor> memory) {
  release_completed_abandoned();
  using Clock = WaitPacer::Clock;
  WaitPacer pacer(Clock::now());
  const uint64_t epoch = MpiEnv::get().epoch();
  for (;;) {
    const auto t0 = Clock::now();
    int done = 0;
    const int rc = MPI_Testall(n, requests, &done, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) {
      keep(requests, n, memory);  // (the failed and completed ones are null now)
      throw_mpi_error(rc, "MPI_Testall", __FILE__, __LINE__);
    }
    if (done) return;
    const auto nap = pacer.after_test(t0, Clock::now());
    if (nap.count() == 0) continue;
    // The first failure's message rides along: the watchdog may have timed
    // out another Work than the one the user waits on, and this error may be
    // the only one the user sees (naming the rank that stopped answering).
    if (MpiEnv::get().epoch() != epoch) {
      // Posted before a shrink, on a communicator with lost ranks: it will
      // never complete, and MPI goes on without it.
      keep(requests, n, memory);
      C10_THROW_ERROR(DistBackendError,
                      "ddpx_mpi: abandoning a collective of a group that lost ranks (shrunk)");
    }
    if (MpiEnv::get().broken()) {
      keep(requests, n, memory);
      C10_THROW_ERROR(DistBackendError,
                      "ddpx_mpi: abandoning a collective: an earlier call timed out or failed: " +
                          MpiEnv::get().broken_why());
    }
    std::this_thread::sleep_for(nap);
  }
}

}  // namespace

void keep_until_complete(const std::vector<MPI_Request>& requests,
                         c10::ArrayRef<at::Tensor> memory) {
  keep(requests.data(), static_cast<int>(requests.size()), memory);
}

int64_t abandoned_call_bytes() {
  release_completed_abandoned();
  return abandoned_bytes.load();
}

at::Tensor int_array(const std::vector<int>& values) {
  at::Tensor a = at::empty({static_cast<int64_t>(values.size())}, at::kInt);
  if (!values.empty()) std::memcpy(a.data_ptr<int>(), values.data(), values.size() * sizeof(int));
  return a;
}

void await_request(MPI_Request& request, c10::ArrayRef<at::Tensor> memory) {
  await_all(&request, 1, memory);
}

void await_requests(std::vector<MPI_Request>& requests, c10::ArrayRef<at::Tensor> memory) {
  await_all(requests.data(), static_cast<int>(requests.size()), memory);
}

void check_agreement(MPI_Comm comm, std::initializer_list<int64_t> fingerprint,
                     const std::string& what, const std::string& local_desc) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a over the 64-bit words
  for (int64_t v : fingerprint) {
    h ^= static_cast<uint64_t>(v);
    h *= 1099511628211ULL;
  }
  const auto f = static_cast<int64_t>(h >> 1);  // non-negative, so -f cannot overflow
  const at::Tensor fv = at::tensor({f, -f}, at::kLong);
  int64_t* v = fv.data_ptr<int64_t>();
  MPI_Request req = MPI_REQUEST_NULL;
  DDPX_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, v, 2, MPI_INT64_T, MPI_MAX, comm, &req));
  await_request(req, {fv});
  if (v[0] != -v[1]) {
    C10_THROW_ERROR(DistBackendError,
                    "ddpx_mpi: ranks disagree on " + what +
                        ": it was called with different tensor sizes, dtypes, reduce ops or "
                        "roots on different ranks (this rank: " +
                        local_desc + ")");
  }
}

void check_dense(const at::Tensor& t, const char* arg) {
  TORCH_CHECK(t.defined(), "ddpx_mpi: ", arg, " is an undefined tensor");
  TORCH_CHECK(t.layout() == at::kStrided, "ddpx_mpi: ", arg,
              " must be a dense (strided) tensor, got layout ", t.layout());
}

void check_single(const std::vector<at::Tensor>& tensors, const char* arg) {
  TORCH_CHECK(tensors.size() == 1, "ddpx_mpi: ", arg,
              " must hold exactly one tensor (one device per process), got ", tensors.size());
  check_dense(tensors[0], arg);
}

void check_same_dtype_numel(const at::Tensor& t, const at::Tensor& ref, const char* arg) {
  check_dense(t, arg);
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "ddpx_mpi: ", arg, " has dtype ",
              t.scalar_type(), " but the input has ", ref.scalar_type());
  TORCH_CHECK(t.numel() == ref.numel(), "ddpx_mpi: ", arg, " has ", t.numel(),
              " elements but the input has ", ref.numel());
  TORCH_CHECK(t.device().type() == ref.device().type(), "ddpx_mpi: ", arg, " is on ", t.device(),
              " but the input is on ", ref.device());
}

void check_rank(int64_t rank, int size, const char* arg) {
  TORCH_CHECK(rank >= 0 && rank < size, "ddpx_mpi: ", arg, " is ", rank,
              ", out of range for a group of size ", size);
}

int to_count(int64_t numel, const char* arg) {
  TORCH_CHECK(numel <= INT_MAX, "ddpx_mpi: ", arg, " has ", numel,
              " elements; MPI counts are limited to ", INT_MAX, " per call");
  return static_cast<int>(numel);
}

std::string describe(const at::Tensor& t) {
  return std::to_string(t.numel()) + " x " + std::string(c10::toString(t.scalar_type()));
}

std::vector<int> ranks_in_parent(MPI_Comm comm, MPI_Comm parent) {
  MPI_Group g = MPI_GROUP_NULL;
  MPI_Group pg = MPI_GROUP_NULL;
  DDPX_MPI_CHECK(MPI_Comm_group(comm, &g));
  DDPX_MPI_CHECK(MPI_Comm_group(parent, &pg));
  int n = 0;
  DDPX_MPI_CHECK(MPI_Group_size(g, &n));
  std::vector<int> mine(n), theirs(n);
  std::iota(mine.begin(), mine.end(), 0);
  DDPX_MPI_CHECK(MPI_Group_translate_ranks(g, n, mine.data(), pg, theirs.data()));
  MPI_Group_free(&g);
  MPI_Group_free(&pg);
  return theirs;
}

}  // namespace ddpx::comm::detail
