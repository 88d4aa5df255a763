#include "plugin/comm/post_order.h"

#include <pthread.h>
#include <time.h>

#include <iterator>
#include <vector>

#include "plugin/comm/deadline_thread.h"

namespace ddpx::comm::detail {

// The callbacks of one Work, from its Future's hand-out until they return.
struct PostOrder::Chain : std::enable_shared_from_this<Chain> {
  explicit Chain(std::shared_ptr<PostOrder> o) : order(std::move(o)) {}

  const std::shared_ptr<PostOrder> order;
  // The chain whose callbacks opened this one (it waits on this one, often).
  std::weak_ptr<Chain> opener;
  // Fields below: guarded by order->mu_.
  Entries::iterator barrier;  // valid until settled
  bool settled = false;
  bool running = false;  // a thread is inside its callbacks (Running)
  int in_flight = 0;     // its collectives whose Works have not finished
  // Step 3's watch over the running thread.
  clockid_t cpu_clock{};
  int64_t cpu_at_tick = 0;
  int idle_ticks = 0;
};

namespace {

thread_local PostOrder::Chain* running_here = nullptr;

int64_t cpu_ns(clockid_t clock) {
  timespec ts{};
  if (clock_gettime(clock, &ts) != 0) return 0;
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// Step 3's clock: one thread for every order, armed while a chain runs.
// Leaked on purpose, as the watchdog's (threads may use it at exit).
DeadlineThread& ticker() {
  static auto* thread = new DeadlineThread(
      "ddpx_mpi_order", [](void* key, std::chrono::milliseconds) -> std::function<void()> {
        // Armed, so alive: Running disarms before it lets its chain go.
        auto chain = static_cast<PostOrder::Chain*>(key)->shared_from_this();
        return [chain] { chain->order->tick(chain); };
      });
  return *thread;
}

}  // namespace

PostOrder::Chain* PostOrder::context_locked() const {
  Chain* c = running_here;
  return c != nullptr && c->order.get() == this && !c->settled ? c : nullptr;
}

PostOrder::Entries::iterator PostOrder::insertion_point_locked(Chain* context) {
  return context != nullptr ? context->barrier : entries_.end();
}

void PostOrder::yield_locked(Chain* chain, Entries::iterator before) {
  // The chains that wait on this one (its openers) must let the same calls
  // pass, or they would hold them in its stead.
  std::vector<std::shared_ptr<Chain>> chains{chain->shared_from_this()};
  for (auto up = chain->opener.lock(); up && !up->settled; up = up->opener.lock()) {
    chains.push_back(up);
  }
  for (const auto& c : chains) {
    bool ahead = before == entries_.end();
    for (auto it = c->barrier; !ahead && it != entries_.end(); ++it) ahead = it == before;
    if (ahead) entries_.splice(before, entries_, c->barrier);
  }
}

bool PostOrder::yield_past_locked(Chain* chain, const void* key) {
  for (auto it = std::next(chain->barrier); it != entries_.end(); ++it) {
    if (it->key == key && it->barrier_of == nullptr) {
      yield_locked(chain, std::next(it));
      return true;
    }
  }
  return false;
}

void PostOrder::release_locked() {
  while (!entries_.empty() && entries_.front().barrier_of == nullptr) {
    Entry e = std::move(entries_.front());
    entries_.pop_front();
    e.release(e.key != nullptr ? numbered_++ : 0);
  }
}

void PostOrder::post(const void* key, Release release, std::shared_ptr<Chain>* issued_by) {
  std::lock_guard<std::mutex> lock(mu_);
  Chain* c = context_locked();
  if (c != nullptr && issued_by != nullptr) {
    ++c->in_flight;
    *issued_by = c->shared_from_this();  // before the call can finish
  }
  entries_.insert(insertion_point_locked(c), Entry{key, std::move(release), nullptr});
  release_locked();
}

std::shared_ptr<PostOrder::Chain> PostOrder::open_chain(const void* key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto chain = std::make_shared<Chain>(shared_from_this());
  Chain* c = context_locked();
  if (c != nullptr) {
    chain->opener = c->weak_from_this();
    yield_past_locked(c, key);  // step 2: a callback took a held call's Future
  }
  chain->barrier = entries_.insert(insertion_point_locked(c), Entry{key, {}, chain.get()});
  release_locked();
  return chain;
}

void PostOrder::waiting_on(const void* key) {
  std::lock_guard<std::mutex> lock(mu_);
  Chain* c = context_locked();
  if (c != nullptr && yield_past_locked(c, key)) release_locked();
}

void PostOrder::finished(const std::shared_ptr<Chain>& own, const std::shared_ptr<Chain>& parent) {
  std::lock_guard<std::mutex> lock(mu_);
  if (own && !own->settled) {
    own->settled = true;
    entries_.erase(own->barrier);
  }
  if (parent) --parent->in_flight;
  release_locked();
}

size_t PostOrder::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& e : entries_) n += e.barrier_of == nullptr;
  return n;
}

void PostOrder::arm_tick_locked(Chain* chain) { ticker().arm(chain, kTick); }

void PostOrder::tick(const std::shared_ptr<Chain>& chain) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!chain->running || chain->settled) return;  // not re-armed
  bool behind = false;                            // a call held behind this chain
  for (auto it = std::next(chain->barrier); !behind && it != entries_.end(); ++it) {
    behind = it->barrier_of == nullptr;
  }
  const int64_t cpu = cpu_ns(chain->cpu_clock);
  const bool idle = behind && chain->in_flight == 0 &&
                    cpu - chain->cpu_at_tick < std::chrono::nanoseconds(kIdleCpu).count();
  chain->cpu_at_tick = cpu;
  chain->idle_ticks = idle ? chain->idle_ticks + 1 : 0;
  if (chain->idle_ticks >= kIdleTicks) {  // step 3
    chain->idle_ticks = 0;
    yield_locked(chain.get(), entries_.end());
    release_locked();
  }
  arm_tick_locked(chain.get());
}

PostOrder::Running::Running(std::shared_ptr<Chain> chain)
    : chain_(std::move(chain)), outer_(running_here) {
  running_here = chain_.get();
  PostOrder& order = *chain_->order;
  std::lock_guard<std::mutex> lock(order.mu_);
  chain_->running = true;
  chain_->idle_ticks = 0;
  // Without this thread's clock step 3 cannot tell waiting from working:
  // such a chain never yields by it.
  if (pthread_getcpuclockid(pthread_self(), &chain_->cpu_clock) != 0) return;
  chain_->cpu_at_tick = cpu_ns(chain_->cpu_clock);
  order.arm_tick_locked(chain_.get());
}

PostOrder::Running::~Running() {
  {
    std::lock_guard<std::mutex> lock(chain_->order->mu_);
    chain_->running = false;  // from here no tick re-arms it
  }
  ticker().disarm(chain_.get());
  running_here = outer_;
}

}  // namespace ddpx::comm::detail
