// ddpx-train --mode ps: the first --servers ranks serve (ddpx::ps::Server),
// the others train on their shard of the data and push gradients; with
// --servers colocated every rank does both, its server on a thread of its
// own. Progress lines and metrics come from rank 0's server, out of what the pushes report
// (loss, correct, samples), so no collective slows the workers; the final
// test accuracy is scored by every rank on the servers' parameters.
#include <ddpx/comm.h>
#include <ddpx/ps.h>
#include <torch/nn/functional/loss.h>
#include <torch/utils.h>  // torch::manual_seed

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "plugin/trainer/checkpoint.h"
#include "plugin/trainer/data.h"
#include "plugin/trainer/model.h"
#include "plugin/trainer/optim.h"
#include "plugin/trainer/run_common.h"
#include "plugin/trainer/trainer.h"

namespace ddpx::trainer {
namespace {

using Clock = std::chrono::steady_clock;

nlohmann::json staleness_json(const ps::Staleness& s) {
  nlohmann::json hist = nlohmann::json::object();
  for (size_t i = 0; i < s.counts.size(); ++i) {
    if (s.counts[i] > 0) hist[std::to_string(i)] = s.counts[i];
  }
  return {{"mean", s.mean()},
          {"p50", s.percentile(0.5)},
          {"p99", s.percentile(0.99)},
          {"max", s.max()},
          {"histogram", hist}};
}

std::string histogram_text(const ps::Staleness& s) {
  std::ostringstream os;
  const int64_t total = std::max<int64_t>(1, s.total());
  for (size_t i = 0; i < s.counts.size(); ++i) {
    if (s.counts[i] == 0) continue;
    char line[96];
    std::snprintf(line, sizeof line, "    %4zu  %8lld  %5.1f%%  ", i, (long long)s.counts[i],
                  100.0 * double(s.counts[i]) / double(total));
    os << line << std::string(static_cast<size_t>(40 * s.counts[i] / total), '#') << "\n";
  }
  return os.str();
}

// A worker's own checkpoint of its push codec's error feedback
// (ps::Worker::save_residuals), beside the servers': <--checkpoint>.worker<w>.0
// and .1, written in turn after every --checkpoint-every-th push and the
// last. The servers save after the same updates (sync: update = step), so
// the file that matches their last checkpoint is one of the two even if the
// job died between a worker's save and the servers'.
class WorkerResiduals {
 public:
  WorkerResiduals(const Options& o, int w)
      : on_(!o.checkpoint.empty() && o.codec != "none"),
        every_(o.checkpoint_every),
        base_(o.checkpoint + ".worker" + std::to_string(w) + "."),
        w_(w) {}

  // --resume: the saved residuals of the step the servers restored this
  // worker to, if there are any. The next save goes to the other file.
  void restore(ps::Worker& worker, bool quiet) {
    if (!on_) return;
    bool seen = false;
    for (int gen : {0, 1}) {
      const std::string path = base_ + std::to_string(gen);
      if (!std::filesystem::exists(path)) continue;
      seen = true;
      std::ifstream in(path, std::ios::binary);
      const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
      TORCH_CHECK(in.good() || in.eof(), "ddpx-train: cannot read ", path);
      if (worker.restore_residuals(bytes)) {
        saves_ = gen + 1;
        if (!quiet) {
          std::cout << "[ddpx-train] worker " << w_ << " restored its codec residuals of step "
                    << worker.start_step() << std::endl;
        }
        return;
      }
    }
    if (worker.start_step() > 0) {
      std::cerr << "[ddpx-train] worker " << w_ << ": "
                << (seen ? "no saved codec residuals are of step " : "no codec residuals saved for step ")
                << worker.start_step() << "; it goes on without them (not bit for bit)"
                << std::endl;
    }
  }

  void after_push(const ps::Worker& worker, int64_t pushes, bool last) {
    if (!on_ || !(last || (every_ > 0 && pushes % every_ == 0))) return;
    write_durably(base_ + std::to_string(saves_++ % 2), worker.save_residuals());
  }

 private:
  bool on_;
  int64_t every_;
  std::string base_;
  int w_;
  int64_t saves_ = 0;
};

}  // namespace

std::string run_ps(const Options& o) {
  TORCH_CHECK(o.global_batch == 0, "ddpx-train: --global-batch is for --mode sync (a parameter "
              "server's workers each take --batch-size samples per push)");
  TORCH_CHECK(comm::detect_launcher() == comm::Launcher::Mpi,
              "ddpx-train: --mode ps runs under mpirun (servers and workers talk MPI point to "
              "point), e.g. mpirun -np 3 ddpx-train --mode ps --servers 1 ...");
  const auto timeout = o.timeout_s > 0
                           ? std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000))
                           : comm::default_timeout();
  auto pg = comm::init_from_env(timeout);  // ddpx_mpi: starts MPI, scores the test set
  const int rank = pg->getRank(), world = pg->getSize();
  const bool lead = rank == 0;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(o.threads > 0 ? o.threads : std::max(1, cores / local_ranks()));
  torch::manual_seed(o.seed);

  ScriptedModel sm = load_model(o.model);
  torch::jit::Module& model = sm.module;
  model.train();
  std::vector<at::Tensor> params;
  for (const auto& p : model.parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }

  // The schedule runs on the servers' version: one update per gradient
  // (async, ssp) or per round (sync), so total_updates is known only once
  // the session knows the worker count.
  int64_t total_updates = 1;
  static_assert(kServersColocated == ps::kColocated);
  const bool colocated = o.servers == kServersColocated;
  ps::Options po;
  po.servers = o.servers;
  po.consistency = o.consistency;
  po.codec = o.codec;
  po.pull_codec = o.ps_pull_codec;
  po.pull = o.ps_pull == "prefetch"       ? ps::PullMode::Prefetch
            : o.ps_pull == "inconsistent" ? ps::PullMode::Inconsistent
                                          : ps::PullMode::AfterPush;
  po.deterministic = o.ps_deterministic;
  po.staleness_lr = o.ps_staleness_lr;
  po.delay_comp = o.ps_delay_comp;
  po.timeout_s = o.timeout_s;
  // N workers pushing asynchronously act like momentum of about 1 - 1/N on
  // top of the optimizer's own (Mitliagkas et al. 2016, "Asynchrony begets
  // momentum"): LeNet at momentum 0.9 with 2 async workers stayed at 10-16%
  // test accuracy, at 0.4 it reached 91% in 80 steps. So by default the
  // server's SGD momentum is reduced by that much (said at start-up).
  Options server_o = o;
  const bool async_like =
      ps::Consistency::parse(o.consistency).kind != ps::Consistency::Kind::Sync;
  const int n_workers = colocated ? world : std::max(1, world - o.servers);
  if (async_like && o.ps_async_momentum == "auto" && o.optimizer == "sgd") {
    server_o.momentum = std::max(0.0, o.momentum - (1.0 - 1.0 / n_workers));
  }
  po.make_optimizer = [&server_o](std::vector<at::Tensor> p) {
    return make_optimizer(std::move(p), server_o);
  };
  po.lr_at = [&o, &total_updates](int64_t v) { return lr_at(v, total_updates, o); };
  // Each server keeps its own checkpoint, <--checkpoint>.server<k>; the
  // period counts steps of every worker (updates per step: N, or 1 in sync).
  const std::string my_checkpoint =
      o.checkpoint.empty() ? "" : o.checkpoint + ".server" + std::to_string(rank);
  if (!my_checkpoint.empty()) {
    const bool sync_mode =
        ps::Consistency::parse(o.consistency).kind == ps::Consistency::Kind::Sync;
    po.checkpoint_every = o.checkpoint_every * (sync_mode ? 1 : n_workers);
    po.on_checkpoint = [&my_checkpoint](const std::string& bytes) {
      write_durably(my_checkpoint, bytes);
    };
  }
  ps::Session session(params, po);

  const DataSplit data = load_data(o, sm);
  const int workers = session.num_workers();
  const int64_t per_worker = data.train.size() / workers;
  const int64_t steps_per_epoch = per_worker / o.batch_size;
  TORCH_CHECK(steps_per_epoch > 0, "ddpx-train: --batch-size ", o.batch_size, " exceeds the ",
              per_worker, " training samples each of ", workers, " workers holds");
  const int64_t total = o.steps > 0 ? o.steps : o.epochs * steps_per_epoch;  // per worker
  const bool sync = session.consistency().kind == ps::Consistency::Kind::Sync;
  const int64_t per_step = sync ? 1 : workers;  // updates per step of every worker
  total_updates = total * per_step;

  std::string restored;  // a server's saved state (--resume)
  if (session.is_server() && !my_checkpoint.empty()) {
    const bool exists = std::filesystem::exists(my_checkpoint);
    TORCH_CHECK(o.resume || !exists, "ddpx-train: checkpoint ", my_checkpoint,
                " already exists; pass --resume to continue from it, or choose another "
                "--checkpoint path (a fresh run never overwrites a checkpoint)");
    if (o.resume && exists) {
      std::ifstream in(my_checkpoint, std::ios::binary);
      restored.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      TORCH_CHECK(in.good() || in.eof(), "ddpx-train: cannot read ", my_checkpoint);
    }
  }
  std::ofstream metrics;
  if (lead && !o.metrics.empty()) {
    metrics.open(o.metrics, restored.empty() ? std::ios::trunc : std::ios::app);
    TORCH_CHECK(metrics, "ddpx-train: cannot write --metrics ", o.metrics);
  }
  if (lead && !o.quiet) {
    std::cout << "[ddpx-train] " << o.model << ": " << params.size() << " parameter tensors, "
              << (colocated ? "colocated servers on every rank, "
                            : std::to_string(o.servers) + " server(s) + ")
              << workers << " worker(s), consistency "
              << session.consistency().str() << ", " << total << " steps of " << o.batch_size
              << " samples per worker, push codec " << o.codec
              << ", pull codec " << o.ps_pull_codec << std::endl;
    if (server_o.momentum != o.momentum) {
      std::cout << "[ddpx-train] async momentum: the server applies " << server_o.momentum
                << " for --momentum " << o.momentum << " (" << n_workers
                << " asynchronous workers add about " << 1.0 - 1.0 / n_workers
                << "; --ps-async-momentum as-given keeps it)" << std::endl;
    }
  }

  const auto t_start = Clock::now();
  double last_loss = 0, last_acc = 0;  // of the last progress window, as --mode sync reports
  ps::ServerStats mine;
  ps::WorkerStats wstats;
  // Rank 0's server reports progress after each update (colocated: on its
  // server's thread, which alone touches what it captures until join()).
  auto t_window = t_start;
  ps::ServerStats prev;
  auto on_update = [&](const ps::ServerStats& st) {
    if (!lead) return;
    const int64_t every = o.log_every * per_step;
    if (st.updates % every != 0 && st.updates != total_updates) return;
    const auto now = Clock::now();
    const double dt = std::chrono::duration<double>(now - t_window).count();
    const double elapsed = std::chrono::duration<double>(now - t_start).count();
    const double n = std::max(1.0, st.samples - prev.samples);
    const double loss = last_loss = (st.loss_sum - prev.loss_sum) / n;
    const double acc = last_acc = (st.correct - prev.correct) / n;
    const double rate = (st.samples - prev.samples) / std::max(dt, 1e-9);
    const int64_t step = st.updates / per_step;
    if (!o.quiet) {
      char line[256];
      std::snprintf(
          line, sizeof line,
          "[ddpx-train] step %lld/%lld  loss %.4f  acc %5.1f%%  %.0f samples/s  "
          "staleness mean %.2f max %lld  ETA %s",
          (long long)step, (long long)total, loss, 100 * acc, rate, st.staleness.mean(),
          (long long)st.staleness.max(),
          eta(elapsed / double(std::max<int64_t>(1, step)) * double(total - step)).c_str());
      std::cout << line << std::endl;
    }
    if (metrics.is_open()) {
      metrics << nlohmann::json{{"step", step},
                                {"version", st.version},
                                {"loss", loss},
                                {"accuracy", acc},
                                {"samples_per_s", rate},
                                {"lr", lr_at(st.version - 1, total_updates, o)},
                                {"elapsed_s", elapsed},
                                {"applied", st.applied},
                                {"dropped", st.dropped},
                                {"bytes_received", st.bytes_received},
                                {"staleness", staleness_json(st.staleness)}}
                     .dump()
              << std::endl;
    }
    prev = st;
    t_window = now;
  };
  std::unique_ptr<ps::Server> server;  // stopped by its destructor if the worker fails
  if (session.is_server()) {
    server = std::make_unique<ps::Server>(session);
    if (!restored.empty()) {
      prev = server->restore(restored);  // progress windows go on from there
      if (lead && !o.quiet) {
        std::cout << "[ddpx-train] resumed the servers from " << o.checkpoint << ".server<k>"
                  << std::endl;
      }
    }
    if (colocated) {
      server->start(on_update);
    } else {
      mine = server->serve(on_update);
    }
  }
  if (session.is_worker()) {
    const int w = session.worker_index();
    ps::Worker worker(session);
    at::Tensor idx;
    int64_t epoch = -1;
    worker.pull();  // the first reply says where a resumed run stands
    const int64_t first = worker.start_step();
    WorkerResiduals residuals(o, w);
    if (o.resume) residuals.restore(worker, o.quiet);
    for (int64_t step = first; step < total; ++step) {
      if (step / steps_per_epoch != epoch) {
        epoch = step / steps_per_epoch;
        idx = shard_indices(data.train.size(), w, workers, epoch, o.seed);
      }
      const at::Tensor rows = idx.narrow(0, (step % steps_per_epoch) * o.batch_size, o.batch_size);
      const at::Tensor x = data.train.inputs.index_select(0, rows);
      const at::Tensor y = data.train.targets.index_select(0, rows);
      if (step > first) worker.pull();  // its reply came in while the batch was gathered
      for (auto& p : params) p.mutable_grad() = at::Tensor();
      const at::Tensor logits = model.forward({x}).toTensor();
      const at::Tensor loss = torch::nn::functional::cross_entropy(logits, y);
      straggle(o, session.rank());
      loss.backward();
      const double correct = logits.argmax(1).eq(y).sum().item<double>();
      worker.push(loss.item<double>() * double(o.batch_size), correct, double(o.batch_size));
      residuals.after_push(worker, step + 1, step + 1 == total);
    }
    worker.finish();
    wstats = worker.stats();
    if (colocated) mine = server->join();
  }
  session.share_final(params);
  const ps::ServerStats st = session.gather_stats(mine);
  // The ranks still in (a worker the servers dropped is left out) finish
  // together: share_final, the sums and the test score run among them.
  auto w = session.sum_final(at::tensor({double(wstats.pushes), double(wstats.bytes_sent),
                                          double(wstats.bytes_raw), wstats.wait_us,
                                          double(wstats.pull_bytes), double(wstats.pull_bytes_raw)},
                                         at::kDouble));
  const double test_acc =
      evaluate(model, data.test, session.final_rank(), session.final_size(),
               [&session](const at::Tensor& t) { return session.sum_final(t); }, 256);
  const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
  if (!lead) return "";
  const double pushes = w[0].item<double>();
  const double compression =
      w[2].item<double>() > 0 ? w[1].item<double>() / w[2].item<double>() : 1;
  const double pull_ratio =
      w[5].item<double>() > 0 ? w[4].item<double>() / w[5].item<double>() : 1;
  const double loss = last_loss, acc = last_acc;
  if (!o.quiet) {
    char line[320];
    std::snprintf(line, sizeof line,
                  "[ddpx-train] done: %lld steps x %d workers in %.1f s, train loss %.4f, train "
                  "acc %.1f%%, test accuracy %.2f%%",
                  (long long)total, workers, elapsed, loss, 100 * acc, 100 * test_acc);
    std::cout << line << std::endl;
    std::snprintf(line, sizeof line,
                  "[ddpx-train] parameter server: %lld updates, %lld gradients applied, %lld "
                  "dropped, %lld worker(s) lost; pushes %.0f B each (x%.3f of float32), "
                  "pulls x%.3f; workers waited %.1f ms per step for parameters",
                  (long long)st.version, (long long)(st.applied / session.num_servers()),
                  (long long)(st.dropped / session.num_servers()), (long long)session.lost_ranks().size(),
                  pushes > 0 ? w[1].item<double>() / pushes : 0.0, compression, pull_ratio,
                  pushes > 0 ? w[3].item<double>() / pushes / 1000 : 0.0);
    std::cout << line << std::endl;
    std::snprintf(line, sizeof line,
                  "[ddpx-train] staleness (versions): mean %.2f  p50 %lld  p99 %lld  max %lld",
                  st.staleness.mean(), (long long)st.staleness.percentile(0.5),
                  (long long)st.staleness.percentile(0.99), (long long)st.staleness.max());
    std::cout << line << "\n" << histogram_text(st.staleness) << std::flush;
  }
  if (metrics.is_open()) {
    metrics
        << nlohmann::json{{"event", "end"},
                          {"step", total},
                          {"loss", loss},
                          {"accuracy", acc},
                          {"test_accuracy", test_acc},
                          {"elapsed_s", elapsed},
                          {"updates", st.version},
                          {"applied", st.applied / session.num_servers()},
                          {"dropped", st.dropped / session.num_servers()},
                          {"workers_lost", session.lost_ranks().size()},
                          {"bytes_sent_per_step", pushes > 0 ? w[1].item<double>() / pushes : 0},
                          {"compression", compression},
                          {"pull_bytes_per_step", pushes > 0 ? w[4].item<double>() / pushes : 0},
                          {"pull_compression", pull_ratio},
                          {"pull_wait_us_per_step", pushes > 0 ? w[3].item<double>() / pushes : 0},
                          {"staleness", staleness_json(st.staleness)}}
               .dump()
        << std::endl;
  }
  std::string outcome = "ok";
  for (size_t i = 0; i < session.lost_ranks().size(); ++i) {
    outcome += (i == 0 ? ", ranks lost: " : " ") + std::to_string(session.lost_ranks()[i]);
  }
  return outcome;
}

}  // namespace ddpx::trainer
