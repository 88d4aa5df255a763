// Parameter gates and their registry (hooks/param_gate.h).
#include "hooks/param_gate.h"

#include <chrono>
#include <shared_mutex>
#include <unordered_map>

#include "hooks/stream_handoff.h"

namespace ddpx::hooks {

namespace {
struct Entry {
  std::weak_ptr<Gates> gates;
  int index;
};
// Both live until the process ends: a GradSync destroyed by a static
// destructor still unregisters safely.
std::shared_mutex& registry_mutex() {
  static auto* m = new std::shared_mutex();
  return *m;
}
std::unordered_map<const c10::TensorImpl*, Entry>& registry() {
  static auto* r = new std::unordered_map<const c10::TensorImpl*, Entry>();  // outlives statics
  return *r;
}
}  // namespace

std::shared_ptr<Gates> Gates::make(const std::vector<at::Tensor>& tensors,
                                   const std::vector<std::string>& names) {
  std::shared_ptr<Gates> g(new Gates());
  const size_t n = tensors.size();
  g->open_.assign(n, 1);
  g->passed_.assign(n, 1);
  g->after_.assign(n, nullptr);
  std::unique_lock<std::shared_mutex> lock(registry_mutex());
  auto& r = registry();
  for (size_t i = 0; i < n; ++i) {
    const auto* impl = tensors[i].unsafeGetTensorImpl();
    const auto it = r.find(impl);
    if (it != r.end() && !it->second.gates.expired()) {
      for (auto* done : g->impls_) r.erase(done);
      g->impls_.clear();
      TORCH_CHECK(false, "GradSync: '", names[i], "' is already gated by another GradSync with "
                  "Overlap::NextForward; a tensor can await one GradSync's updates only");
    }
    r[impl] = Entry{g, static_cast<int>(i)};
    g->impls_.push_back(tensors[i].unsafeGetTensorImpl());
  }
  return g;
}

Gates::~Gates() {
  std::unique_lock<std::shared_mutex> lock(registry_mutex());
  auto& r = registry();
  for (auto* impl : impls_) {
    auto it = r.find(impl);
    if (it != r.end() && it->second.gates.expired()) r.erase(it);
  }
}

void Gates::close_all() {
  std::lock_guard<std::mutex> lock(mu_);
  std::fill(open_.begin(), open_.end(), 0);
  std::fill(passed_.begin(), passed_.end(), 0);
  std::fill(after_.begin(), after_.end(), nullptr);
}

void Gates::open(int i, std::shared_ptr<const StreamFence> after) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    open_[i] = 1;
    if (after) after_[i] = std::move(after);
  }
  cv_.notify_all();
}

void Gates::open_all(const std::shared_ptr<const StreamFence>& after) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < open_.size(); ++i) {
      // (A gate opened earlier keeps its own update's fence.)
      if (!open_[i] && after) after_[i] = after;
      open_[i] = 1;
    }
  }
  cv_.notify_all();
}

void Gates::fail(std::exception_ptr e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = std::move(e);
    std::fill(open_.begin(), open_.end(), 1);
  }
  cv_.notify_all();
}

void Gates::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  error_ = nullptr;
  std::fill(passed_.begin(), passed_.end(), 1);
}

void Gates::wait(int i) {
  std::unique_lock<std::mutex> lock(mu_);
  std::chrono::steady_clock::time_point t0, t1;
  if (!open_[i]) {
    t0 = std::chrono::steady_clock::now();
    cv_.wait(lock, [&] { return open_[i] != 0; });
    t1 = std::chrono::steady_clock::now();
    wait_us_ += std::chrono::duration<double, std::micro>(t1 - t0).count();
    ++waits_;
  }
  passed_[i] = 1;
  if (error_) std::rethrow_exception(error_);
  const auto after = after_[i];
  lock.unlock();
  if (after) after->block_current();
  if (on_wait_ && t1 > t0) on_wait_(i, t0, t1);
}

void Gates::wait_all() {
  for (size_t i = 0; i < open_.size(); ++i) wait(static_cast<int>(i));
}

bool Gates::passed(int i) {
  std::lock_guard<std::mutex> lock(mu_);
  return passed_[i] != 0;
}

std::pair<double, int64_t> Gates::take_waits() {
  std::lock_guard<std::mutex> lock(mu_);
  auto out = std::make_pair(wait_us_, waits_);
  wait_us_ = 0;
  waits_ = 0;
  return out;
}

void wait_gate(const at::Tensor& t) {
  std::shared_ptr<Gates> g;
  int index = 0;
  {
    std::shared_lock<std::shared_mutex> lock(registry_mutex());
    const auto& r = registry();
    const auto it = r.find(t.unsafeGetTensorImpl());
    if (it == r.end()) return;
    g = it->second.gates.lock();
    index = it->second.index;
  }
  if (g) g->wait(index);
}

}  // namespace ddpx::hooks
