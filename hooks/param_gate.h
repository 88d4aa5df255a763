#pragma once
// Parameter gates (Overlap::NextForward): after a backward, each parameter
// (and buffer) of a GradSync is closed until its update has landed; a read
// in the next forward waits at its own gate, so the forward starts while
// later buckets are still on the wire. Reads reach the gates through the
// ddpx::param_ready op, which the graph pass below puts before every read
// of a parameter or buffer in a scripted model (torch::nn trainers call
// GradSync::wait_ready). The op finds a tensor's gate by its TensorImpl in a
// process-wide registry, so it works in methods shared by several module
// instances (six blocks of one type run one graph).
#include <ATen/ATen.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

namespace torch::jit {
struct Module;
}

namespace ddpx::hooks {

class StreamFence;

class Gates : public std::enable_shared_from_this<Gates> {
 public:
  // Registers `tensors` (none may already be gated by another GradSync).
  static std::shared_ptr<Gates> make(const std::vector<at::Tensor>& tensors,
                                     const std::vector<std::string>& names);
  ~Gates();
  Gates(const Gates&) = delete;
  Gates& operator=(const Gates&) = delete;

  void close_all();  // the end of a backward: every tensor awaits its update
  // `after` (device tensors; null on the CPU): the update's work on its
  // streams. The host opens the gate once that work is queued, not done, so
  // a reader's stream is made to wait for it when the reader passes.
  void open(int i, std::shared_ptr<const StreamFence> after = nullptr);
  void open_all(const std::shared_ptr<const StreamFence>& after = nullptr);
  // The step failed: every gate opens and a wait rethrows `e`, until reset.
  void fail(std::exception_ptr e);
  void reset();  // the failure was reported
  // Blocks while gate i is closed (rethrows a failure) and notes the pass;
  // then orders the caller's current streams after the update (open's
  // `after`), as a read of a device tensor is queued work too.
  void wait(int i);
  void wait_all();  // every gate, passing all (synchronize)
  // Was tensor i read through its gate since the gates last closed (or
  // have they not closed since)? A read without it may have raced.
  bool passed(int i);
  // Total waiting since the last call (us) and the number of waits.
  std::pair<double, int64_t> take_waits();
  // Called after each wait that blocked, with the tensor and the wait's
  // start and end (GradSync: an event per gate wait in its trace).
  using WaitFn = std::function<void(int, std::chrono::steady_clock::time_point,
                                    std::chrono::steady_clock::time_point)>;
  void on_wait(WaitFn f) { on_wait_ = std::move(f); }

 private:
  Gates() = default;
  std::vector<c10::TensorImpl*> impls_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char> open_, passed_;
  std::vector<std::shared_ptr<const StreamFence>> after_;  // per gate, from open
  std::exception_ptr error_;
  double wait_us_ = 0;
  int64_t waits_ = 0;
  WaitFn on_wait_;  // set before any wait
};

// The ddpx::param_ready kernel's work: waits at `t`'s gate, if any.
void wait_gate(const at::Tensor& t);

// Puts ddpx::param_ready after every read (prim::GetAttr) of a parameter or
// buffer in every method of every module type in `m`, each graph once, and
// returns how many reads it gated. Must run before the module's first
// forward: a method already run keeps the graph it compiled.
int insert_gates(const torch::jit::Module& m);

}  // namespace ddpx::hooks
