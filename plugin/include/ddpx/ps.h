#pragma once
// ddpx::ps — an asynchronous parameter server over MPI.
//
// Every rank of the MPI job runs this; the first opts.servers ranks serve,
// the others train. (tests/cpp/test_example_ps.cpp runs this text as it
// stands: with one worker it equals local SGD bit for bit.)
// [example ps_train]
//   template <class Model>
//   void train(Model& model, const at::Tensor& x, const at::Tensor& y, int steps) {
//     ddpx::ps::Options opts;  // 1 server, async, pulls after each push
//     opts.make_optimizer = [](std::vector<at::Tensor> shard) {
//       return std::make_unique<torch::optim::SGD>(shard, torch::optim::SGDOptions(0.1));
//     };
//     ddpx::ps::Session ps(model->parameters(), opts);  // collective over MPI_COMM_WORLD
//     if (ps.is_server()) {
//       ddpx::ps::Server(ps).serve();  // until every worker has finished
//     } else {
//       ddpx::ps::Worker w(ps);
//       for (int step = 0; step < steps; ++step) {
//         w.pull();  // the servers' newest parameters
//         auto loss = torch::mse_loss(model->forward(x), y);
//         loss.backward();
//         w.push(loss.item().toDouble());  // sends .grad, then unsets it
//       }
//       w.finish();
//     }
//     ps.share_final(model->parameters());  // the servers' values on every rank
//   }
// [end example]
//
// Colocated servers (Options::servers = kColocated): every rank trains and
// serves 1/W of the parameters, so no rank carries every worker's traffic
// (BytePS's "summation service" on each machine). The server runs on a
// thread of its own beside the rank's worker. (tests/cpp/test_example_ps.cpp
// runs this text too: with one rank, or with 2 ranks on the same data, it
// equals local SGD bit for bit.)
// [example ps_colocated]
//   template <class Model>
//   void train_colocated(Model& model, const at::Tensor& x, const at::Tensor& y, int steps) {
//     ddpx::ps::Options opts;
//     opts.servers = ddpx::ps::kColocated;  // every rank serves a shard and trains
//     opts.consistency = "sync";            // each update: the mean of every rank's gradient
//     opts.make_optimizer = [](std::vector<at::Tensor> shard) {
//       return std::make_unique<torch::optim::SGD>(shard, torch::optim::SGDOptions(0.1));
//     };
//     ddpx::ps::Session ps(model->parameters(), opts);
//     ddpx::ps::Server server(ps);
//     server.start();  // serves this rank's shard on a thread of its own
//     ddpx::ps::Worker w(ps);
//     for (int step = 0; step < steps; ++step) {
//       w.pull();
//       auto loss = torch::mse_loss(model->forward(x), y);
//       loss.backward();
//       w.push(loss.item().toDouble());
//     }
//     w.finish();
//     server.join();  // returns once every rank's worker has finished
//     ps.share_final(model->parameters());
//   }
// [end example]
//
// MPI. The Session initialises MPI if nothing has (MPI_Init_thread at
// MPI_THREAD_MULTIPLE: servers receive on a progress thread while their
// main thread serves) and finalises it at process exit. A program that
// initialised MPI itself keeps it: ddpx uses MPI_COMM_WORLD, duplicated,
// never finalises it, and needs MPI_THREAD_MULTIPLE from it (a lower level
// is a c10::Error at Session construction); that program calls
// MPI_Finalize after the Session is gone.
//
// What one worker trains. With one worker and AfterPush pulls, every
// consistency equals local training with the servers' optimizer bit for bit
// (each step's push is applied before the reply the next step starts from).
// Prefetch pulls ask for the next parameters while the step computes, so a
// step starts from the values before the previous push was applied: one step
// stale, even alone. Inconsistent pulls may install each server's shard at a
// different version.
//
// Roles. One MPI job of W ranks: ranks 0..K-1 are servers, K..W-1 workers
// (N = W - K; worker w is rank K + w). Colocated: K = N = W, rank r is
// server r and worker r, and what a worker sends its own rank's shard (and
// the reply) is handed over in memory, not through MPI. The parameters (float32, contiguous)
// are laid end to end as one flat vector of T elements; server k owns the
// elements [k*T/K, (k+1)*T/K) -- balanced by bytes, so a large tensor may be
// split between servers. A server's shard is a list of segments (the pieces
// of tensors it owns), each updated by the server's own optimizer.
//
// Protocol (on two private duplicates of MPI_COMM_WORLD, one for what
// workers send servers and one for what servers send workers, so that a
// colocated server's any-source receive never takes its own worker's reply;
// byte messages):
//   0. Session construction (collective, once): every rank checks that all
//      ranks hold the same parameter list (count, shapes, dtypes) and options
//      (servers, consistency, codec, pull mode, deterministic); a difference
//      is a c10::Error naming it on every rank. No further handshake: there is
//      no hello/ready round trip per worker or per message.
//   1. PULL  worker -> every server: {kind, worker, seq}. Sent once at the
//      start, each step in Prefetch mode, and to each server whose reply came
//      in Inconsistent mode. The server answers at once.
//   2. PUSH  worker -> every server: a self-describing message
//        header {kind, worker, seq, base version (of that server's shard the
//                gradient was computed on), codec id + argument, flags,
//                loss/correct/samples of the step, segment count}
//        int64 length of each segment's payload in bytes
//        payloads, each the codec's message (plugin/comm/codec_message.h),
//                followed with flag DELAY_COMP by g * g * w_base of the
//                segment as float32 (Options::delay_comp)
//      The server takes it with MPI_Improbe(ANY_SOURCE) -> MPI_Get_count ->
//      MPI_Mrecv on its progress thread: any size, any order, no pre-sent
//      size, no padding. It checks the header (worker = source rank, segment
//      count and every length against its shard and the codec) and refuses a
//      wrong message with an ERROR reply naming what was wrong; nothing of it
//      is applied.
//      Flag AFTER_PUSH (pull mode AfterPush): "reply with the parameters that
//      follow this push" -- the pull is folded into the push.
//   3. The server's consistency gate decides when a push is applied:
//        async     in arrival order (deterministic: in the fixed order worker
//                  0, 1, ..., N-1 of each seq, whatever the arrival order,
//                  and only once every worker has had its first parameters);
//        ssp:S     stale synchronous parallel (Ho et al. 2013): pushes are
//                  applied as they come, and a worker's clock (its pushes the
//                  server is done with) may be at most S ahead of the slowest
//                  live worker's: the reply to a worker further ahead is held
//                  until the slowest catches up (or is dropped). S = 0 is
//                  lockstep; any S >= 0. With S >= N - 1 pushes are also held
//                  so that no applied gradient is more than S versions stale
//                  (sorted by base b_(i), the i-th gradient in flight is
//                  applied at version + 1 + i at the earliest, so each needs
//                  version + 1 + i - b_(i) <= S; the oldest held push goes
//                  first, so nothing waits for ever); below N - 1 no order
//                  can promise that. Needs AfterPush pulls (the reply is the
//                  gate);
//        sync[:n]  pushes on the current version are collected; when n of them
//                  (default N; fewer if fewer workers are live) are in, their
//                  mean (summed in worker order) is applied once; a push on an
//                  older version is dropped (n < N: backup workers).
//      Applying = set the learning rate lr_at(version) (divided by the
//      staleness tau when staleness_lr and tau > 1), set the segments' .grad,
//      optimizer.step(), version += 1, record staleness = version before the
//      step - base version.
//   4. REPLY server -> worker: {version, kind, delta} + the shard's float32
//      values (delta 0), or with a pull codec after the first reply (delta 1)
//      the codec's message of the difference to what the worker holds (see
//      Options::pull_codec); its size is fixed by the codec and checked on
//      arrival. Sent when the push was applied or
//      dropped (AfterPush) or at once (PULL). The worker receives every
//      server's reply into a buffer of its own and copies them into the
//      parameters only at pull(): a step never sees a half-written model
//      (consistent reads; per server, the versions of two servers may differ).
//      Inconsistent pulls install each server's shard as soon as it is in,
//      without waiting for the others or for a reply at all.
//   5. BYE   worker -> every server after its last push. A server returns
//      from serve() when every worker said BYE or was dropped.
//   6. Liveness: a server that hears nothing from a worker for the timeout
//      (a worker sends a HEARTBEAT each timeout/4 from a thread of its own)
//      drops it (logged) and goes on; the ssp bound and the sync quorum count
//      live workers only. Servers send each worker they have not dropped a
//      HEARTBEAT each timeout/4 too (a reply held by the gate is not a silence), and a worker
//      that, waiting for a reply, hears nothing from a server for the timeout
//      throws a c10::Error naming that server's rank.
//   7. After training the ranks still in agree on who they are: the servers
//      merge (MAX-allreduce among themselves) the lists of workers each
//      dropped, and server 0 sends the result to every other worker (FINAL;
//      servers keep sending heartbeats to workers that said BYE until then,
//      so a worker waiting for it names a dead server within the timeout).
//      With workers dropped, the ranks left make a communicator of their own
//      (MPI_Comm_create_group: only its members take part), and rank 0 ends
//      the job at exit with MPI_Abort(code 0), which also ends a frozen
//      worker that would hold mpirun for ever. Then Session::share_final
//      (each server broadcasts its shard), gather_stats and sum_final run
//      on it. A killed worker thus costs the others nothing -- if mpirun lets
//      them live: Open MPI 4's mpirun ends the job when a rank dies unless
//      given --mca orte_enable_recovery 1 (and then exits 0 whatever happened).
//   Colocated: every rank is a server, so the servers' agreement is every
//   rank's, and no FINAL is sent. A rank that is lost takes its shard with
//   it: the others' next pull names that server ("server k (rank k) sent
//   nothing ...") within the timeout, and the job ends there; with
//   checkpoints, start it again from them (ddpx-train --resume), at the same
//   world size (each shard's checkpoint is its own).
//   Checkpoints: a server hands its state (shard, optimizer state, version,
//   counters, and each worker's next seq) to Options::on_checkpoint; restored,
//   its first REPLY to each worker carries that worker's next seq, from which
//   the worker goes on (Worker::start_step).
#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ddpx::ps {

// "async" | "ssp:<S>" | "sync" | "sync:<n>"; anything else is a c10::Error.
struct Consistency {
  enum class Kind { Async, Ssp, Sync };
  Kind kind = Kind::Async;
  int64_t bound = 0;   // ssp: S (clocks a worker may run ahead of the slowest)
  int64_t quorum = 0;  // sync: n (0: every worker)
  static Consistency parse(const std::string& spec);
  std::string str() const;
};

enum class PullMode {
  AfterPush,  // parameters that include this worker's last push (1 worker = local SGD)
  Prefetch,   // fetched while the step computes: the newest at the step's start
  // AsySG-InCon's inconsistent read: pull() never waits (after the first);
  // each shard that has come in since the last pull goes in and is asked
  // for again, the others stay, so a step may mix versions of different
  // servers' shards. async only.
  Inconsistent,
};

// Options::servers: every rank trains and serves a shard (see Roles).
constexpr int kColocated = -1;

struct Options {
  int servers = 1;  // K dedicated server ranks (the first K), or kColocated
  std::string consistency = "async";
  std::string codec = "none";  // pushes: none | fp16 | bf16 | int8[:c] | topk:<r>
  // Pulls: "none" sends the shard's float32 values; a codec sends the
  // difference between them and what that worker already holds, encoded
  // (fp16 | bf16 | int8[:c] | topk:<r>). The server keeps a float32 copy of
  // what each worker holds and updates it with the decoded message, as the
  // worker does, so the two stay equal bit for bit and whatever a message
  // left out goes with the next one (error feedback; nothing accumulates).
  // A worker's first reply is always exact.
  std::string pull_codec = "none";
  PullMode pull = PullMode::AfterPush;
  bool deterministic = false;  // async: fixed application order (round robin)
  double timeout_s = 0;        // 0: DDPX_TIMEOUT_S, else 300
  // Server side: the optimizer over a shard's segments, and the learning rate
  // of the update that makes version v + 1 (unset: the optimizer's own).
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)> make_optimizer;
  std::function<double(int64_t version)> lr_at;
  // A gradient applied tau > 1 versions stale gets the learning rate / tau
  // (staleness-aware async SGD, Zhang et al. 2016); fresh and sync updates
  // keep it.
  bool staleness_lr = false;
  // Delay compensation (DC-ASGD, Zheng et al. 2017; 0: off). A gradient g
  // computed on w_base and applied to w_now is applied as
  //   g + lambda * g * g * (w_now - w_base),
  // a first-order Taylor step of the gradient from w_base to w_now with
  // g * g standing in for the Hessian's diagonal. The server keeps no copy
  // of any worker's parameters: the worker sends g * g * w_base beside g (as
  // float32: a push grows by 4 bytes per element) and the server subtracts it
  // from g * g * w_now. With a lossy codec, g is the decoded gradient on both
  // sides. Not with sync (its gradients are never stale).
  double delay_comp = 0;
  // Server checkpoints: after every checkpoint_every updates (0: never) and
  // when serve() ends, on_checkpoint gets this server's state as bytes to
  // store; Server::restore takes them back.
  int64_t checkpoint_every = 0;
  std::function<void(const std::string& state)> on_checkpoint;
  // Test hook: a worker sleeps this long (us) before each push, drawn per
  // step from [0, max_push_delay_us) with its own seed (emulates stragglers).
  int64_t max_push_delay_us = 0;
};

// Staleness of the applied gradients: exact counts per value.
struct Staleness {
  std::vector<int64_t> counts;  // counts[s]: gradients applied s versions stale
  int64_t total() const;
  double mean() const;
  int64_t percentile(double p) const;  // smallest s with >= p of the mass at or below
  int64_t max() const;
  void add(int64_t s, int64_t n = 1);
  void merge(const Staleness& o);
};

struct ServerStats {
  int64_t version = 0;
  int64_t applied = 0;         // gradients applied
  int64_t dropped = 0;         // gradients dropped (sync: late)
  int64_t updates = 0;         // optimizer steps
  int64_t bytes_received = 0;  // push payload + headers (colocated: the rank's own too)
  int64_t bytes_raw = 0;       // float32-equivalent of the pushed gradients
  int64_t workers_lost = 0;
  double loss_sum = 0, correct = 0, samples = 0;  // as the workers reported
  Staleness staleness;
};

struct WorkerStats {
  int64_t pushes = 0;
  int64_t bytes_sent = 0;
  int64_t bytes_raw = 0;
  int64_t pulls = 0;               // replies installed (per server)
  int64_t pull_bytes = 0;          // their payloads as received
  int64_t pull_bytes_raw = 0;      // the same values as float32
  double wait_us = 0;  // time pull() waited for replies
};

namespace detail {
class ServerImpl;
class WorkerImpl;
}  // namespace detail

class Session {
 public:
  // Collective over MPI_COMM_WORLD (ranks >= 2; colocated, >= 1). params:
  // the model's trainable parameters, the same list on every rank (float32,
  // contiguous).
  Session(std::vector<at::Tensor> params, Options opts);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  bool is_server() const;
  bool is_worker() const;  // colocated: both, on every rank
  bool colocated() const;
  int worker_index() const;  // this rank's worker number w, or -1 (a dedicated server)
  int rank() const;
  int num_servers() const;
  int num_workers() const;
  const Options& options() const;
  const Consistency& consistency() const;
  const std::vector<at::Tensor>& params() const;
  double timeout_s() const;
  // Collective over the servers and the workers they did not drop (step 7):
  // every such rank's params become the servers' values; servers call it
  // after serve(), workers after finish().
  void share_final(const std::vector<at::Tensor>& params);
  // Collective, the same ranks: the servers' stats merged (each gets them).
  // Servers pass what serve() returned, workers a default ServerStats.
  // Merged, field by field:
  //   version                   server 0's (each server counts its own
  //                             shard's updates; they are not added)
  //   applied, dropped, updates, bytes_received, bytes_raw, staleness
  //                             summed over the servers: every push reaches
  //                             every server, so with K servers `applied` is
  //                             K times the pushes applied (2 servers that
  //                             each applied 40 pushes: applied 80)
  //   workers_lost              summed over the servers (lost_ranks() has
  //                             the distinct workers)
  //   loss_sum, correct, samples  one server's worth (the sum divided by K):
  //                             every server hears every worker's report
  ServerStats gather_stats(const ServerStats& mine);
  // Collective, the same ranks: the element-wise sum of a float64 tensor.
  at::Tensor sum_final(const at::Tensor& t);
  // This rank's place among them, and their number.
  int final_rank() const;
  int final_size() const;
  // The world ranks left out: the workers the servers dropped.
  const std::vector<int>& lost_ranks() const;

  // Internals (communicator, layout), defined in plugin/ps/session_state.h.
  struct State;
  State& state() const { return *s_; }

 private:
  std::unique_ptr<State> s_;
};

class Server {
 public:
  explicit Server(Session& session);
  // A server still serving on its thread (start(), then an error before
  // join()) is stopped: its workers then name it when they time out.
  ~Server();
  // Runs until every worker said BYE or was dropped. on_update (optional) is
  // called on this thread after every optimizer step. Dedicated servers only
  // (colocated, this rank's own worker needs the calling thread).
  ServerStats serve(const std::function<void(const ServerStats&)>& on_update = {});
  // Colocated: serve() on a thread of its own (on_update is called there),
  // so that this rank's Worker, made after start(), trains on the caller's.
  // join(), after Worker::finish(), waits for it to end and returns what
  // serve() would have; a failure of that thread is rethrown here (and is
  // an error of this rank's worker as soon as it waits for its shard).
  void start(const std::function<void(const ServerStats&)>& on_update = {});
  ServerStats join();
  // Before serve(): continue from a state on_checkpoint produced (this
  // server's, same model and worker count; otherwise a c10::Error). Returns
  // the restored counters.
  ServerStats restore(const std::string& state);

 private:
  std::unique_ptr<detail::ServerImpl> impl_;
};

class Worker {
 public:
  explicit Worker(Session& session);
  ~Worker();
  // Makes the parameters the newest the servers sent (blocks until they are
  // in). The first call fetches the initial values.
  void pull();
  // Pushes the parameters' .grad (undefined = zero) to the servers, after
  // backward; loss/correct/samples are reported to the servers' metrics.
  void push(double loss = 0, double correct = 0, double samples = 0);
  // After the first pull: how many of this worker's pushes the servers had
  // finished with when they were restored (0 on a fresh run): the step to
  // go on from.
  int64_t start_step() const;
  // A lossy push codec's error feedback (fp16, bf16, int8, top-k) is this
  // worker's own: what its pushes so far have not carried. save_residuals
  // gives it as bytes for a checkpoint of the worker's, tagged with the
  // number of pushes made. After the first pull, restore_residuals takes
  // such bytes back if they follow the push the servers restored this
  // worker to (start_step()) and returns true; bytes of another step return
  // false and change nothing (the run goes on without them, no longer bit
  // for bit). Bytes of another push codec or model are a c10::Error. With
  // sync consistency, residuals saved after each push that is a multiple of
  // the servers' checkpoint_every match their checkpoints.
  std::string save_residuals() const;
  bool restore_residuals(const std::string& bytes);
  // The version of server 0's shard the parameters hold.
  int64_t version() const;
  void finish();
  WorkerStats stats() const;

 private:
  std::unique_ptr<detail::WorkerImpl> impl_;
};

}  // namespace ddpx::ps
