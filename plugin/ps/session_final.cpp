// ddpx::ps::Session after training (step 7 of the protocol in ddpx/ps.h).
// First the ranks that are still in agree on who they are: the servers merge
// the lists of workers each dropped (killed, frozen, refused), and server 0
// sends the result to every worker it does not hold; the workers wait for it
// while heartbeats still come, so a server that dies meanwhile is named
// within the timeout. Without those left out, the final collectives run on a
// communicator of their own (MPI_Comm_create_group needs only its members),
// so a killed worker cannot stop the others from finishing; rank 0 then ends
// the job at exit (MPI_Abort, code 0), which ends a frozen one too.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <ddpx/ps.h>

#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "plugin/comm/mpi_env.h"
#include "plugin/comm/wait_pacer.h"
#include "plugin/ps/session_state.h"
#include "plugin/ps/wire.h"

namespace ddpx::ps {

using comm::detail::MpiEnv;
using comm::detail::WaitPacer;

namespace detail {

// The collectives after training must not wait for ever for a rank that
// never joins (a frozen worker the servers dropped): each is started
// nonblocking and waited for at most the timeout. Then the job is marked
// broken (MPI_Abort at exit, which ends the frozen rank too), the buffers are
// leaked (MPI may still write them) and a c10::Error says what happened.
void await_bounded(MPI_Request& r, double timeout_s, const std::string& what,
                   const std::vector<at::Tensor>& buffers) {
  using comm::detail::WaitPacer;
  const auto start = WaitPacer::Clock::now();
  WaitPacer pacer(start);
  while (true) {
    const auto t0 = WaitPacer::Clock::now();
    int done = 0;
    DDPX_MPI_CHECK(MPI_Test(&r, &done, MPI_STATUS_IGNORE));
    if (done) return;
    if (std::chrono::duration<double>(t0 - start).count() > timeout_s) {
      for (const auto& b : buffers) new at::Tensor(b);
      MpiEnv::get().mark_broken("ddpx ps: " + what + " never completed");
      TORCH_CHECK(false, "ddpx ps: ", what, " did not complete within ", timeout_s,
                  " s (DDPX_TIMEOUT_S): a rank never joined it (a worker the servers dropped, "
                  "or a server that stopped)");
    }
    const auto nap = pacer.after_test(t0, WaitPacer::Clock::now());
    if (nap.count() > 0) std::this_thread::sleep_for(nap);
  }
}

// An allreduce of a contiguous CPU tensor, waited for at most timeout_s.
at::Tensor bounded_allreduce(MPI_Comm comm, const at::Tensor& t, MPI_Datatype type, MPI_Op op,
                             double timeout_s, const std::string& what) {
  at::Tensor out = at::empty_like(t);
  MPI_Request r;
  DDPX_MPI_CHECK(MPI_Iallreduce(t.data_ptr(), out.data_ptr(), static_cast<int>(t.numel()), type, op,
                                comm, &r));
  await_bounded(r, timeout_s, what, {t, out});
  return out;
}

namespace {

// A worker, after its BYE: server 0's list of dropped workers. The servers
// may first wait up to the timeout for a silent worker to be dropped; their
// heartbeats say they are alive meanwhile.
at::Tensor receive_final_list(const Session::State& s) {
  const int workers = s.workers;
  at::Tensor lost = at::zeros({workers}, at::kInt);
  const std::chrono::duration<double> timeout(s.timeout_s);
  auto heard = WaitPacer::Clock::now();
  WaitPacer pacer(heard);
  while (true) {
    const auto t0 = WaitPacer::Clock::now();
    int flag = 0;
    MPI_Status st;
    DDPX_MPI_CHECK(MPI_Iprobe(0, kFinal, s.wcomm, &flag, &st));
    if (flag) {
      int count = 0;
      DDPX_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &count));
      TORCH_CHECK(count == 4 * workers,
                  "ddpx ps: the final list of live workers from server 0 "
                  "has ",
                  count, " bytes, expected ", 4 * workers);
      DDPX_MPI_CHECK(
          MPI_Recv(lost.data_ptr(), workers, MPI_INT32_T, 0, kFinal, s.wcomm, MPI_STATUS_IGNORE));
      return lost;
    }
    DDPX_MPI_CHECK(MPI_Iprobe(0, kHeartbeat, s.wcomm, &flag, &st));
    if (flag) {
      int count = 0;
      DDPX_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &count));
      std::vector<char> note(static_cast<size_t>(count));
      DDPX_MPI_CHECK(
          MPI_Recv(note.data(), count, MPI_BYTE, 0, kHeartbeat, s.wcomm, MPI_STATUS_IGNORE));
      heard = t0;
    }
    if (t0 - heard > timeout) {
      MpiEnv::get().mark_broken("ddpx ps: server 0 went silent before the end");
      TORCH_CHECK(false, "ddpx ps: server 0 (rank 0) sent nothing for ", timeout.count(),
                  " s (DDPX_TIMEOUT_S) while worker ", s.worker_of(s.rank),
                  " waited for the final list of live workers: the server died or is frozen");
    }
    const auto nap = pacer.after_test(t0, WaitPacer::Clock::now());
    if (nap.count() > 0) std::this_thread::sleep_for(nap);
  }
}

}  // namespace

MPI_Comm final_comm(Session::State& s) {
  if (s.final_comm != MPI_COMM_NULL) return s.final_comm;
  const int K = s.servers, workers = s.workers;
  at::Tensor lost = at::zeros({workers}, at::kInt);
  if (s.rank < K) {
    lost = bounded_allreduce(s.servers_comm, at::tensor(c10::ArrayRef<int32_t>(s.lost), at::kInt),
                             MPI_INT32_T, MPI_MAX, s.timeout_s,
                             "the servers' agreement on the live workers");
    if (s.rank == 0) {
      std::vector<MPI_Request> sends;
      for (int w = 0; w < workers; ++w) {
        // Colocated workers are servers too: they took part in the agreement.
        if (lost[w].item<int32_t>() || s.worker_rank(w) < K) continue;
        sends.emplace_back();
        DDPX_MPI_CHECK(MPI_Isend(lost.data_ptr(), workers, MPI_INT32_T, s.worker_rank(w), kFinal,
                                 s.wcomm, &sends.back()));
      }
      for (auto& r2 : sends)
        await_bounded(r2, s.timeout_s, "the final list of live workers", {lost});
    }
  } else {
    lost = receive_final_list(s);
  }
  s.lost.assign(lost.data_ptr<int32_t>(), lost.data_ptr<int32_t>() + workers);
  s.lost_ranks.clear();
  for (int w = 0; w < workers; ++w) {
    if (s.lost[w]) s.lost_ranks.push_back(s.worker_rank(w));
  }
  if (s.lost_ranks.empty()) {
    s.final_comm = s.comm;
    return s.final_comm;
  }
  std::ostringstream ranks;
  for (size_t i = 0; i < s.lost_ranks.size(); ++i) ranks << (i ? ", " : "") << s.lost_ranks[i];
  // A colocated rank's worker is lost only with its process, and its shard
  // with it: nobody holds those parameters any more.
  TORCH_CHECK(!s.colocated, "ddpx ps: rank(s) ", ranks.str(), " were lost, and the shard(s) "
              "they served (colocated) with them: the parameters cannot be put together. "
              "Resume from the last checkpoint (--resume)");
  MPI_Group world, live;
  DDPX_MPI_CHECK(MPI_Comm_group(s.comm, &world));
  DDPX_MPI_CHECK(
      MPI_Group_excl(world, static_cast<int>(s.lost_ranks.size()), s.lost_ranks.data(), &live));
  DDPX_MPI_CHECK(MPI_Comm_create_group(s.comm, live, kFinal, &s.final_comm));
  MPI_Group_free(&live);
  MPI_Group_free(&world);
  if (s.rank == 0) {
    std::fprintf(stderr,
                 "[ddpx ps] finishing without the worker(s) the servers dropped (rank %s)\n",
                 ranks.str().c_str());
    MpiEnv::get().end_job_at_exit("the servers dropped rank(s) " + ranks.str() +
                                  ", which may still be running (frozen)");
  }
  return s.final_comm;
}

}  // namespace detail

using detail::await_bounded;

void Session::share_final(const std::vector<at::Tensor>& params) {
  TORCH_CHECK(params.size() == s_->params.size(), "ddpx ps: share_final got ", params.size(),
              " parameters; the session has ", s_->params.size());
  at::NoGradGuard no_grad;
  // Servers are ranks 0..K-1 of the final communicator too (only workers are
  // ever left out, and MPI_Group_excl keeps the order).
  const MPI_Comm comm = detail::final_comm(*s_);
  for (int k = 0; k < s_->servers; ++k) {
    const auto& segs = s_->layout.shards[k];
    at::Tensor buf = at::empty({s_->layout.shard_numel[k]}, at::kFloat);
    int64_t off = 0;
    if (s_->rank == k) {
      for (const auto& sg : segs) {
        buf.narrow(0, off, sg.numel)
            .copy_(params[sg.param].view(-1).narrow(0, sg.offset, sg.numel));
        off += sg.numel;
      }
    }
    MPI_Request r;
    DDPX_MPI_CHECK(
        MPI_Ibcast(buf.data_ptr(), static_cast<int>(buf.numel()), MPI_FLOAT, k, comm, &r));
    await_bounded(r, s_->timeout_s, "the final broadcast of server " + std::to_string(k), {buf});
    off = 0;
    for (const auto& sg : segs) {
      params[sg.param].view(-1).narrow(0, sg.offset, sg.numel).copy_(buf.narrow(0, off, sg.numel));
      off += sg.numel;
    }
  }
}

ServerStats Session::gather_stats(const ServerStats& mine) {
  // Counters are summed over the servers; the version is server 0's. One
  // bounded allreduce of int64 (length first, so every rank sizes the
  // histogram alike) and one of double.
  const MPI_Comm comm = detail::final_comm(*s_);
  auto allreduce = [&](const at::Tensor& t, MPI_Datatype type, MPI_Op op) {
    return detail::bounded_allreduce(comm, t, type, op, s_->timeout_s,
                                     "the final gathering of the servers' statistics");
  };
  const int64_t len = static_cast<int64_t>(mine.staleness.counts.size());
  const int64_t max_len =
      allreduce(at::tensor({len}, at::kLong), MPI_INT64_T, MPI_MAX)[0].item<int64_t>();
  std::vector<int64_t> ints = {is_server() && rank() == 0 ? mine.version : 0,
                               mine.applied,
                               mine.dropped,
                               mine.updates,
                               mine.bytes_received,
                               mine.bytes_raw,
                               mine.workers_lost};
  const size_t head = ints.size();
  ints.resize(head + max_len, 0);
  for (int64_t i = 0; i < len; ++i) ints[head + i] = mine.staleness.counts[i];
  const at::Tensor summed =
      allreduce(at::tensor(c10::ArrayRef<int64_t>(ints), at::kLong), MPI_INT64_T, MPI_SUM);
  const std::vector<int64_t> sum(summed.data_ptr<int64_t>(),
                                 summed.data_ptr<int64_t>() + summed.numel());
  const at::Tensor dsum_t = allreduce(
      at::tensor({mine.loss_sum, mine.correct, mine.samples}, at::kDouble), MPI_DOUBLE, MPI_SUM);
  const double dsum[3] = {dsum_t[0].item<double>(), dsum_t[1].item<double>(),
                          dsum_t[2].item<double>()};
  const int64_t version = sum[0];
  std::vector<int64_t> rest(sum.begin() + 1, sum.end());
  ServerStats out;
  out.version = version;
  out.applied = rest[0];
  out.dropped = rest[1];
  out.updates = rest[2];
  out.bytes_received = rest[3];
  out.bytes_raw = rest[4];
  out.workers_lost = rest[5];
  out.staleness.counts.assign(sum.begin() + static_cast<std::ptrdiff_t>(head), sum.end());
  // Each server saw every worker's loss: report one server's worth.
  const double k = s_->servers;
  out.loss_sum = dsum[0] / k;
  out.correct = dsum[1] / k;
  out.samples = dsum[2] / k;
  return out;
}

at::Tensor Session::sum_final(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kDouble && t.is_contiguous() && t.device().is_cpu(),
              "ddpx ps: sum_final takes a contiguous float64 CPU tensor, got ", t.toString());
  return detail::bounded_allreduce(detail::final_comm(*s_), t, MPI_DOUBLE, MPI_SUM, s_->timeout_s,
                                   "a final sum over the ranks");
}

int Session::final_rank() const {
  int r = 0;
  DDPX_MPI_CHECK(MPI_Comm_rank(detail::final_comm(*s_), &r));
  return r;
}

int Session::final_size() const {
  int n = 0;
  DDPX_MPI_CHECK(MPI_Comm_size(detail::final_comm(*s_), &n));
  return n;
}

const std::vector<int>& Session::lost_ranks() const {
  detail::final_comm(*s_);
  return s_->lost_ranks;
}

}  // namespace ddpx::ps
