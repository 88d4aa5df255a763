// ddpx::ps::Session: the set-up every rank does once (step 0 of the protocol
// in ddpx/ps.h). The collectives after training (step 7): session_final.cpp.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <ddpx/ps.h>

#include <algorithm>
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

// A string every rank gets from `root` (collective).
std::string bcast_string(MPI_Comm comm, const std::string& s, int root) {
  int64_t n = static_cast<int64_t>(s.size());
  DDPX_MPI_CHECK(MPI_Bcast(&n, 1, MPI_INT64_T, root, comm));
  std::string out = s;
  out.resize(static_cast<size_t>(n));
  DDPX_MPI_CHECK(MPI_Bcast(out.data(), static_cast<int>(n), MPI_CHAR, root, comm));
  return out;
}

// Every rank must pass the same values: a MAX-allreduce of [x, -x] shows any
// difference on every rank at once. Then (the error path only) the first
// rank whose values differ from rank 0's is found, and the error names the
// fields that differ and what rank 0 and that rank have.
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
  if (bad.empty()) return;
  int rank = 0, size = 1;
  DDPX_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  DDPX_MPI_CHECK(MPI_Comm_size(comm, &size));
  std::vector<int64_t> root(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n));
  DDPX_MPI_CHECK(MPI_Bcast(root.data(), static_cast<int>(n), MPI_INT64_T, 0, comm));
  int mine_first = std::equal(root.begin(), root.end(), v.begin()) ? size : rank;
  int first = size;
  DDPX_MPI_CHECK(MPI_Allreduce(&mine_first, &first, 1, MPI_INT, MPI_MIN, comm));
  const std::string at0 = bcast_string(comm, mine, 0);
  const std::string other = bcast_string(comm, mine, first);
  TORCH_CHECK(false, "ddpx ps: the ranks disagree on the ", bad, ": rank 0 has ", at0, "; rank ",
              first, " has ", other, ". Every rank must run the same model with the same options");
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
  s_->colocated = opts.servers == kColocated;
  TORCH_CHECK(s_->colocated || (opts.servers >= 1 && opts.servers < s_->size),
              "ddpx ps: --servers must be in [1, ", s_->size - 1, "] (the world size ", s_->size,
              " minus at least one worker) or colocated (ps::kColocated), got ", opts.servers);
  s_->servers = s_->colocated ? s_->size : opts.servers;
  s_->workers = s_->colocated ? s_->size : s_->size - opts.servers;
  s_->consistency = Consistency::parse(opts.consistency);
  const auto codec = parse_codec(opts.codec, "codec (pushes)");
  const auto pull_codec = parse_codec(opts.pull_codec, "pull codec");
  const int workers = s_->workers;
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
    shapes << (shapes.tellp() > 0 ? " " : "") << p.sizes();
    numels.push_back(p.numel());
  }
  std::ostringstream mine;
  mine << params.size() << " parameters " << shapes.str().substr(0, 200) << ", servers "
       << (s_->colocated ? std::string("colocated") : std::to_string(opts.servers)) << ", consistency " << s_->consistency.str() << ", codec " << codec.spec()
       << ", pull codec " << pull_codec.spec();
  DDPX_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &s_->comm));
  DDPX_MPI_CHECK(MPI_Comm_set_errhandler(s_->comm, MPI_ERRORS_RETURN));
  DDPX_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &s_->wcomm));
  DDPX_MPI_CHECK(MPI_Comm_set_errhandler(s_->wcomm, MPI_ERRORS_RETURN));
  // The servers' own communicator (step 7's agreement), made while every rank is in.
  DDPX_MPI_CHECK(MPI_Comm_split(s_->comm, s_->rank < s_->servers ? 0 : MPI_UNDEFINED, s_->rank,
                                &s_->servers_comm));
  s_->lost.assign(static_cast<size_t>(workers), 0);
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
  s_->layout = detail::Layout::plan(numels, s_->servers);
  if (s_->colocated) s_->local = std::make_unique<detail::LocalLink>();
  s_->timeout_s = opts.timeout_s > 0 ? opts.timeout_s : env_timeout();
  s_->params = std::move(params);
  s_->opts = std::move(opts);
}

Session::~Session() {
  if (!s_) return;
  if (s_->final_comm != MPI_COMM_NULL && s_->final_comm != s_->comm) MPI_Comm_free(&s_->final_comm);
  if (s_->servers_comm != MPI_COMM_NULL) MPI_Comm_free(&s_->servers_comm);
  if (s_->wcomm != MPI_COMM_NULL) MPI_Comm_free(&s_->wcomm);
  if (s_->comm != MPI_COMM_NULL) MPI_Comm_free(&s_->comm);
}

bool Session::is_server() const { return s_->rank < s_->servers; }
bool Session::is_worker() const { return s_->worker_of(s_->rank) >= 0; }
bool Session::colocated() const { return s_->colocated; }
int Session::worker_index() const { return s_->worker_of(s_->rank); }
int Session::rank() const { return s_->rank; }
int Session::num_servers() const { return s_->servers; }
int Session::num_workers() const { return s_->workers; }
const Options& Session::options() const { return s_->opts; }
const Consistency& Session::consistency() const { return s_->consistency; }
const std::vector<at::Tensor>& Session::params() const { return s_->params; }
double Session::timeout_s() const { return s_->timeout_s; }

}  // namespace ddpx::ps
