#include "plugin/comm/flight_exchange.h"

#include <ddpx/comm.h>

#include <atomic>
#include <future>
#include <map>
#include <thread>

#include "plugin/comm/flight_dump.h"
#include "plugin/comm/flight_report.h"
#include "plugin/comm/flight_triggers.h"
#include "plugin/comm/mpi_store.h"

namespace ddpx::comm::detail {
namespace {

const std::string kAsk = "ddpx_fr/ask";
const std::string kReporter = "ddpx_fr/reporter";
std::string buf_key(int rank) { return "ddpx_fr/buf/" + std::to_string(rank); }

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

struct FrExchange::State {
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  int world = 1;
  std::atomic<bool> stop{false};
  std::atomic<bool> answered{false};

  // Step 1 and the first half of step 2: this rank's buffer, once.
  void answer() {
    if (answered.exchange(true)) return;
    store->set(buf_key(rank), bytes_of(fr_current_dump()));
  }
};

c10::intrusive_ptr<c10d::Store> FrExchange::job_store(c10d::ProcessGroup& pg,
                                                      std::chrono::milliseconds timeout) {
  if (detect_launcher() == Launcher::Mpi && pg.getSize() > 1) {
    return store_over_mpi(pg.getRank(), pg.getSize(), timeout);
  }
  return pg.getStore();
}

FrExchange::FrExchange(c10::intrusive_ptr<c10d::Store> store, int rank, int world)
    : state_(std::make_shared<State>()) {
  state_->store = std::move(store);
  state_->rank = rank;
  state_->world = world;
  if (!FlightRecorder::get().enabled() || world < 2 || !state_->store) return;
  // Detached: a store call may block for the store's whole timeout if the
  // process serving it is stopped; the state outlives this object.
  std::thread([s = state_] {
    try {
      while (!s->stop) {
        if (s->store->check({kAsk})) {
          s->answer();
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    } catch (const std::exception&) {
      // The store is gone (the job is ending): nobody can ask any more.
    }
  }).detach();
}

FrExchange::~FrExchange() { state_->stop = true; }

std::string FrExchange::diagnose(std::chrono::milliseconds grace) {
  if (!FlightRecorder::get().enabled() || state_->world < 2 || !state_->store) return "";
  auto done = std::make_shared<std::promise<std::string>>();
  auto result = done->get_future();
  std::thread([s = state_, grace, done] {
    try {
      s->answer();
      s->store->set(kAsk, bytes_of("1"));
      const auto deadline = std::chrono::steady_clock::now() + grace;
      std::map<int, FrSnapshot> got;
      while (static_cast<int>(got.size()) < s->world) {
        for (int r = 0; r < s->world; ++r) {
          if (got.count(r) || !s->store->check({buf_key(r)})) continue;
          const auto v = s->store->get(buf_key(r));
          got[r] = fr_parse_dump(std::string(v.begin(), v.end()), "rank " + std::to_string(r)).snap;
        }
        if (std::chrono::steady_clock::now() >= deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      if (s->store->add(kReporter, 1) != 1) {
        done->set_value("");
        return;
      }
      std::vector<int> all(s->world);
      for (int r = 0; r < s->world; ++r) all[r] = r;
      done->set_value(fr_analyze(got, all).text);
    } catch (const std::exception& e) {
      done->set_value(std::string("ddpx flight recorder: the buffers could not be gathered (") +
                      e.what() + ")\n");
    }
  }).detach();
  const auto bound = grace + std::chrono::milliseconds(2000);
  if (result.wait_for(bound) != std::future_status::ready) {
    return "ddpx flight recorder: the job's store did not answer within " +
           std::to_string(bound.count()) +
           " ms: the process serving it (rank 0, or the launcher's agent) may be the one stopped\n";
  }
  return result.get();
}

}  // namespace ddpx::comm::detail
