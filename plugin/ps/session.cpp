// ddpx::ps::Session: the set-up every rank does once (step 0 of the protocol
// in ddpx/ps.h) and the collectives after training (step 7).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <ddpx/ps.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

#include "plugin/comm/codec_message.h"
#include "plugin/comm/mpi_env.h"
#include "plugin/comm/wait_pacer.h"
#include "plugin/ps/layout.h"
#include "plugin/ps/session_state.h"

namespace ddpx::ps {

using comm::detail::MpiEnv;

namespace {

// FNV-1a, the same in every process.
int64_t stable_hash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h >> 2);
}

// Every rank must pass the same values: a MAX-allreduce of [x, -x] shows any
// difference on every rank at once; the error names the fields that differ.
void check_same(MPI_Comm comm, const std::vector<std::pair<std::string, int64_t>>& fields,
                const std::string& mine) {
  const size_t n = fields.size();
  std::vector<int64_t> v(2 * n), got(2 * n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = fields[i].second;
    v[n + i] = -fields[i].second;
  }
  DDPX_MPI_CHECK(
      MPI_Allreduce(v.data(), got.data(), static_cast<int>(2 * n), MPI_INT64_T, MPI_MAX, comm));
  std::string bad;
  for (size_t i = 0; i < n; ++i) {
    if (got[i] != -got[n + i]) bad += (bad.empty() ? "" : ", ") + fields[i].first;
  }
  TORCH_CHECK(bad.empty(), "ddpx ps: the ranks disagree on the ", bad, " (this rank has ", mine,
              "); every rank must run the same model with the same options");
}

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

double env_timeout() {
  if (const char* s = std::getenv("DDPX_TIMEOUT_S")) {
    const double v = std::atof(s);
    if (v > 0) return v;
  }
  return 300;
}

// A double as an int64 for check_same: equal exactly when the bits are.
int64_t bits_of(double v) {
  int64_t b = 0;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// A codec spec of the options; an error names which one it was.
comm::MessageCodec parse_codec(const std::string& spec, const char* which) {
  try {
    return comm::MessageCodec::parse(spec);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "ddpx ps: ", which, ": ", e.what_without_backtrace());
  }
}

}  // namespace

Session::Session(std::vector<at::Tensor> params, Options opts) : s_(std::make_unique<State>()) {
  MpiEnv& env = MpiEnv::get();
  TORCH_CHECK(env.multiple(),
              "ddpx ps: needs MPI_THREAD_MULTIPLE (servers receive on a "
              "progress thread); this MPI offers thread level ",
              env.thread_level());
  s_->rank = env.world_rank();
  s_->size = env.world_size();
  TORCH_CHECK(opts.servers >= 1 && opts.servers < s_->size, "ddpx ps: --servers must be in [1, ",
              s_->size - 1, "] (the world size ", s_->size, " minus at least one worker), got ",
              opts.servers);
  s_->consistency = Consistency::parse(opts.consistency);
  const auto codec = parse_codec(opts.codec, "codec (pushes)");
  const auto pull_codec = parse_codec(opts.pull_codec, "pull codec");
  const int workers = s_->size - opts.servers;
  const bool gated = s_->consistency.kind != Consistency::Kind::Async;
  TORCH_CHECK(!opts.deterministic || opts.pull == PullMode::AfterPush,
              "ddpx ps: the deterministic mode needs pulls after each push (a prefetched pull "
              "is answered with whatever version the server holds when it arrives)");
  TORCH_CHECK(!gated || opts.pull == PullMode::AfterPush, "ddpx ps: consistency ",
              s_->consistency.str(),
              " needs pulls after each push (the server gates on the "
              "version each worker computes on), not prefetched pulls");
  TORCH_CHECK(std::isfinite(opts.delay_comp) && opts.delay_comp >= 0,
              "ddpx ps: delay_comp (DC-ASGD's lambda) must be >= 0, got ", opts.delay_comp);
  TORCH_CHECK(opts.delay_comp == 0 || s_->consistency.kind != Consistency::Kind::Sync,
              "ddpx ps: delay compensation with consistency ", s_->consistency.str(),
              " would do nothing: sync applies only gradients of the current version");
  TORCH_CHECK(s_->consistency.kind != Consistency::Kind::Sync || s_->consistency.quorum <= workers,
              "ddpx ps: consistency ", s_->consistency.str(), " waits for more gradients than the ",
              workers, " workers send");
  std::ostringstream shapes;
  std::vector<int64_t> numels;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    TORCH_CHECK(
        p.defined() && p.scalar_type() == at::kFloat && p.is_contiguous() && p.device().is_cpu(),
        "ddpx ps: parameter ", i, " must be a contiguous float32 CPU tensor, got ",
        p.defined() ? p.toString() : "undefined");
    shapes << p.sizes() << ";";
    numels.push_back(p.numel());
  }
  std::ostringstream mine;
  mine << params.size() << " parameters " << shapes.str().substr(0, 200) << ", servers "
       << opts.servers << ", consistency " << s_->consistency.str() << ", codec " << codec.spec()
       << ", pull codec " << pull_codec.spec();
  DDPX_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &s_->comm));
  DDPX_MPI_CHECK(MPI_Comm_set_errhandler(s_->comm, MPI_ERRORS_RETURN));
  check_same(s_->comm,
             {{"parameter count", static_cast<int64_t>(params.size())},
              {"parameter shapes", stable_hash(shapes.str())},
              {"servers", opts.servers},
              {"consistency", stable_hash(s_->consistency.str())},
              {"codec", stable_hash(codec.spec())},
              {"pull codec", stable_hash(pull_codec.spec())},
              {"pull mode", static_cast<int64_t>(opts.pull)},
              {"deterministic", opts.deterministic ? 1 : 0},
              {"staleness_lr", opts.staleness_lr ? 1 : 0},
              {"delay_comp", bits_of(opts.delay_comp)}},
             mine.str());
  s_->layout = detail::Layout::plan(numels, opts.servers);
  s_->timeout_s = opts.timeout_s > 0 ? opts.timeout_s : env_timeout();
  s_->params = std::move(params);
  s_->opts = std::move(opts);
}

Session::~Session() {
  if (s_ && s_->comm != MPI_COMM_NULL) MPI_Comm_free(&s_->comm);
}

bool Session::is_server() const { return s_->rank < s_->opts.servers; }
int Session::rank() const { return s_->rank; }
int Session::num_servers() const { return s_->opts.servers; }
int Session::num_workers() const { return s_->size - s_->opts.servers; }
const Options& Session::options() const { return s_->opts; }
const Consistency& Session::consistency() const { return s_->consistency; }
const std::vector<at::Tensor>& Session::params() const { return s_->params; }
double Session::timeout_s() const { return s_->timeout_s; }

void Session::share_final(const std::vector<at::Tensor>& params) {
  TORCH_CHECK(params.size() == s_->params.size(), "ddpx ps: share_final got ", params.size(),
              " parameters; the session has ", s_->params.size());
  at::NoGradGuard no_grad;
  for (int k = 0; k < s_->opts.servers; ++k) {
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
        MPI_Ibcast(buf.data_ptr(), static_cast<int>(buf.numel()), MPI_FLOAT, k, s_->comm, &r));
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
  auto allreduce = [&](at::Tensor t, MPI_Datatype type, MPI_Op op) {
    at::Tensor out = at::empty_like(t);
    MPI_Request r;
    DDPX_MPI_CHECK(MPI_Iallreduce(t.data_ptr(), out.data_ptr(), static_cast<int>(t.numel()), type,
                                  op, s_->comm, &r));
    await_bounded(r, s_->timeout_s, "the final gathering of the servers' statistics", {t, out});
    return out;
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
  const double k = s_->opts.servers;
  out.loss_sum = dsum[0] / k;
  out.correct = dsum[1] / k;
  out.samples = dsum[2] / k;
  return out;
}

}  // namespace ddpx::ps
