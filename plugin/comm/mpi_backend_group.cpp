// ddpx_mpi group management: split_group (MPI_Comm_split), merge (a group
// of processes met through a store, within one MPI job), reconfigure (the
// group rebuilt in place among handles) and the error state torch asks for
// (getError).
#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <unordered_set>
#include <variant>

#include "plugin/comm/member_id.h"
#include "plugin/comm/mpi_backend.h"
#include "plugin/comm/mpi_env.h"
#include "plugin/comm/mpi_util.h"

namespace ddpx::comm::detail {
namespace {

std::string list(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// Which MPI job this process belongs to: processes of different jobs have
// overlapping world ranks and no communicator in common.
std::string mpi_job() {
  for (const char* v : {"PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"}) {
    if (const char* s = std::getenv(v)) return s;
  }
  return "singleton";
}

// "job:world_rank": a process of this machine's MPI jobs (merge's store
// entries, reconfigure's handles).
std::string member_id() { return mpi_job() + ":" + std::to_string(MpiEnv::get().world_rank()); }

// The world rank in a member_id, which must be of this job.
int world_rank_of(const std::string& id, const char* call) {
  return parse_member_id(id, mpi_job(), MpiEnv::get().world_size(), call);
}

void check_distinct(const std::vector<int>& ranks, const char* what) {
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), "ddpx_mpi: ",
              what, " has duplicates: ", list(ranks));
}

}  // namespace

c10::intrusive_ptr<c10d::Backend> MpiBackend::merge(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const c10::intrusive_ptr<Options>& opts,
                                                    const int& rank, const int& size) {
  TORCH_CHECK(store, "ddpx_mpi: merge() needs a store");
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "ddpx_mpi: merge() rank ", rank,
              " is not in [0, size ", size, ")");
  const auto timeout = opts ? opts->timeout : timeout_;
  // Each member says who it is in MPI_COMM_WORLD; the merged group's ranks
  // follow the store's order (torch draws them with store->add).
  const std::string me = member_id();
  store->set("ddpx_mpi_merge/" + std::to_string(rank), std::vector<uint8_t>(me.begin(), me.end()));
  std::vector<int> world_ranks(size);
  for (int r = 0; r < size; ++r) {
    const std::string key = "ddpx_mpi_merge/" + std::to_string(r);
    store->wait({key}, timeout);
    const auto bytes = store->get(key);
    world_ranks[r] = world_rank_of(std::string(bytes.begin(), bytes.end()), "merge()");
  }
  check_distinct(world_ranks, "merge(): the world ranks that joined");
  return MpiBackend::create(world_ranks, timeout);
}

c10::intrusive_ptr<c10d::Backend> MpiBackend::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const std::vector<int>& ranks,
                                                    const c10::intrusive_ptr<Options>& opts) {
  TORCH_CHECK(!closed_.load(), "ddpx_mpi: split() on a backend that was shut down");
  // torch's splitGroup calls split once per device type this backend serves
  // (cpu, cuda), with the same store, and only skips the repeat when the
  // first call returned a backend: a non-member is asked again. A second
  // MPI_Comm_split there would pair with the members' next collective.
  if (store && store == last_split_store_) return nullptr;
  last_split_store_ = store;
  TORCH_CHECK(!ranks.empty(), "ddpx_mpi: split() ranks must not be empty");
  for (int r : ranks) check_rank(r, size_, "split() ranks entry");
  check_distinct(ranks, "split() ranks");
  const auto it = std::find(ranks.begin(), ranks.end(), rank_);
  const bool member = it != ranks.end();
  // Groups of one split do not overlap, so their smallest rank tells them
  // apart; the position in `ranks` is the new rank.
  const int color = member ? *std::min_element(ranks.begin(), ranks.end()) : MPI_UNDEFINED;
  const int key = member ? static_cast<int>(it - ranks.begin()) : 0;

  // MPI_Comm_split blocks until every rank of this group calls it, and no
  // watchdog covers it: a barrier first (a Work with this group's deadline)
  // turns a rank that never comes into a timeout error here, not a hang.
  barrier(c10d::BarrierOptions())->wait();

  auto worker = member ? worker_for_new_backend() : nullptr;
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm diag = MPI_COMM_NULL;
  std::vector<int> formed;
  run_in_order([&] {
    DDPX_MPI_CHECK(MPI_Comm_split(comm_, color, key, &comm));
    if (comm == MPI_COMM_NULL) return;
    formed = ranks_in_parent(comm, comm_);
    DDPX_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    DDPX_MPI_CHECK(MPI_Comm_dup(comm, &diag));
    DDPX_MPI_CHECK(MPI_Comm_set_errhandler(diag, MPI_ERRORS_RETURN));
  });
  if (!member) return nullptr;
  if (formed != ranks) {
    // The members passed different lists (torch requires the same split on
    // every rank): the group MPI formed is not the one this rank asked for.
    run_in_order([&] {
      MPI_Comm_free(&comm);
      MPI_Comm_free(&diag);
    });
    TORCH_CHECK(false, "ddpx_mpi: split(): rank ", rank_, " asked for the group ", list(ranks),
                " but its members formed ", list(formed),
                ": every rank must pass the same split_ranks");
  }
  const auto timeout = opts ? opts->timeout : timeout_;
  auto child = c10::make_intrusive<MpiBackend>(comm, std::move(worker), timeout, diag);
  if (timing_) child->enableCollectivesTiming();
  return child;
}

#ifdef C10D_BACKEND_HAS_RECONFIGURE
c10d::ReconfigureHandle MpiBackend::get_reconfigure_handle() const { return member_id(); }

c10::intrusive_ptr<c10d::Work> MpiBackend::reconfigure(const c10d::ReconfigureOptions& opts) {
  TORCH_CHECK(!closed_.load(), "ddpx_mpi: reconfigure() on a backend that was shut down");
  // A list keeps its order; a set is put in world-rank order so that every
  // member sees the same ranks.
  std::vector<int> world_ranks;
  if (const auto* handles = std::get_if<std::vector<c10d::ReconfigureHandle>>(&opts.handles)) {
    for (const auto& h : *handles) world_ranks.push_back(world_rank_of(h, "reconfigure()"));
  } else {
    for (const auto& h : std::get<std::unordered_set<c10d::ReconfigureHandle>>(opts.handles)) {
      world_ranks.push_back(world_rank_of(h, "reconfigure()"));
    }
    std::sort(world_ranks.begin(), world_ranks.end());
  }
  TORCH_CHECK(!world_ranks.empty(), "ddpx_mpi: reconfigure(): handles must not be empty");
  check_distinct(world_ranks, "reconfigure(): the handles' world ranks");
  const int me = MpiEnv::get().world_rank();
  TORCH_CHECK(std::find(world_ranks.begin(), world_ranks.end(), me) != world_ranks.end(),
              "ddpx_mpi: reconfigure(): this process's handle (", get_reconfigure_handle(),
              ") is not among the handles");
  // The uuid tells concurrent creations apart (it is fresh per call, as the
  // API requires); MPI tags are non-negative and bounded.
  const int tag = static_cast<int>(static_cast<uint64_t>(opts.uuid) % static_cast<uint64_t>(tag_ub_));
  // A Work on the worker, behind every call posted before: those finish on
  // the old communicator, everything after runs on the new one, and the
  // group's deadline covers members that never come (MPI_Comm_create_group
  // blocks until all of them call it).
  return post(
      c10d::OpType::UNKNOWN, {}, {},
      [this, world_ranks, tag](MpiWorker::Progress&) {
        MPI_Group world_group = MPI_GROUP_NULL;
        MPI_Group group = MPI_GROUP_NULL;
        DDPX_MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
        DDPX_MPI_CHECK(MPI_Group_incl(world_group, static_cast<int>(world_ranks.size()),
                                      world_ranks.data(), &group));
        MPI_Comm comm = MPI_COMM_NULL;
        MPI_Comm diag = MPI_COMM_NULL;
        DDPX_MPI_CHECK(MPI_Comm_create_group(MPI_COMM_WORLD, group, tag, &comm));
        MPI_Group_free(&group);
        MPI_Group_free(&world_group);
        DDPX_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
        DDPX_MPI_CHECK(MPI_Comm_dup(comm, &diag));
        DDPX_MPI_CHECK(MPI_Comm_set_errhandler(diag, MPI_ERRORS_RETURN));
        MPI_Comm_free(&comm_);
        comm_ = comm;
        diag_->replace(diag);
        DDPX_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
        DDPX_MPI_CHECK(MPI_Comm_size(comm_, &size_));
      },
      opts.timeout);
}
#endif  // C10D_BACKEND_HAS_RECONFIGURE

c10d::ErrorType MpiBackend::getError() {
  if (!MpiEnv::get().broken()) return c10d::ErrorType::SUCCESS;
  return MpiEnv::get().broken_why().find("timed out") != std::string::npos
             ? c10d::ErrorType::TIMEOUT
             : c10d::ErrorType::COMM_ERROR;
}

}  // namespace ddpx::comm::detail
