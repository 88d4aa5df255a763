#pragma once
// Shared by the parameter-server suites (test_ps.cpp: dedicated servers,
// test_ps_colocated.cpp): a small model whose every worker's gradient any
// rank can recompute (data seeded by worker and step), so each rank builds
// the reference run locally; and one run of the parameter server, dedicated
// or colocated alike.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ddpx/ps.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <cctype>
#include <chrono>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "plugin/comm/mpi_env.h"
#include "plugin/ps/session_state.h"

namespace ddpx::test::ps_util {

namespace ps = ddpx::ps;

// MPI is started by ddpx (MpiEnv), as in any trainer.
inline int world_size() { return ddpx::comm::detail::MpiEnv::get().world_size(); }

// A two-layer net, [13, 5] + [13] + [3, 13] + [3] = 120 elements: with two
// servers the cut at element 60 splits the first weight.
inline std::vector<at::Tensor> make_params() {
  auto g = at::make_generator<at::CPUGeneratorImpl>(42);
  std::vector<at::Tensor> p = {at::randn({13, 5}, g) * 0.4, at::randn({13}, g) * 0.1,
                               at::randn({3, 13}, g) * 0.3, at::randn({3}, g) * 0.1};
  for (auto& t : p) t.requires_grad_(true);
  return p;
}

inline std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& p) {
  std::vector<at::Tensor> out;
  for (const auto& t : p) out.push_back(t.detach().clone().requires_grad_(true));
  return out;
}

inline void copy_params(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
}

// Worker w's gradient at its step s on `p` (left in p[i].grad()); returns the loss.
inline double compute_grads(const std::vector<at::Tensor>& p, int w, int64_t s) {
  for (const auto& t : p) t.mutable_grad() = at::Tensor();
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 * (w + 1) + s);
  const at::Tensor x = at::randn({8, 5}, g);
  const at::Tensor y = at::randn({8, 3}, g);
  const at::Tensor h = at::tanh(at::addmm(p[1], x, p[0].t()));
  const at::Tensor loss = (at::addmm(p[3], h, p[2].t()) - y).pow(2).mean();
  loss.backward();
  return loss.item<double>();
}

inline double lr_at(int64_t v) { return 0.05 * (1.0 - 0.01 * static_cast<double>(v % 50)); }

inline std::unique_ptr<torch::optim::Optimizer> make_opt(const std::string& kind,
                                                  std::vector<at::Tensor> params) {
  if (kind == "adam") {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
  }
  return std::make_unique<torch::optim::SGD>(
      params, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-4));
}

inline void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& group : opt.param_groups()) group.options().set_lr(lr);
}

inline ps::Options options(int servers, const std::string& consistency, const std::string& opt = "sgd") {
  ps::Options o;
  o.servers = servers;
  o.consistency = consistency;
  o.make_optimizer = [opt](std::vector<at::Tensor> p) { return make_opt(opt, std::move(p)); };
  o.lr_at = lr_at;
  o.timeout_s = 60;
  return o;
}

struct RunResult {
  std::vector<at::Tensor> params;  // the servers' final values, on every rank
  ps::ServerStats stats;           // merged over servers, on every rank
  std::vector<at::Tensor> held;    // a worker's: its parameters after its last pull
  ps::WorkerStats worker;          // a worker's
};

// A PS run: every worker goes on to step `steps`; `before_push` runs on a
// worker before each push (delays), `after_push` after it, `on_start` after
// its first pull; a server restores `state` when given.
inline RunResult run_ps(ps::Options o, int64_t steps,
                        const std::function<void(int w, int64_t s)>& before_push = {},
                        const std::string& state = "",
                        const std::function<void(ps::Worker&)>& after_push = {},
                        const std::function<void(ps::Worker&)>& on_start = {},
                        const std::function<void(ps::Worker&, int w, int64_t s)>& at_step = {}) {
  std::vector<at::Tensor> params = make_params();
  ps::Session session(params, std::move(o));
  ps::ServerStats mine;
  std::vector<at::Tensor> held;
  ps::WorkerStats wstats;
  ps::Server* server = nullptr;  // this rank's, dedicated or colocated
  std::unique_ptr<ps::Server> own;
  if (session.is_server()) {
    own = std::make_unique<ps::Server>(session);
    server = own.get();
    if (!state.empty()) server->restore(state);
    if (!session.colocated()) mine = server->serve();
    else server->start();
  }
  if (session.is_worker()) {
    const int w = session.worker_index();
    ps::Worker worker(session);
    worker.pull();
    if (on_start) on_start(worker);
    for (int64_t s = worker.start_step(); s < steps; ++s) {
      if (at_step) at_step(worker, w, s);
      const double loss = compute_grads(params, w, s);
      if (before_push) before_push(w, s);
      worker.push(loss, 0, 8);
      if (after_push) after_push(worker);
      worker.pull();
    }
    worker.finish();
    held = clone_params(params);
    wstats = worker.stats();
    if (session.colocated()) mine = server->join();
  }
  session.share_final(params);
  return {params, session.gather_stats(mine), held, wstats};
}

inline void expect_bitwise(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(at::equal(got[i], want[i]))
        << "parameter " << i << ": max |diff| " << (got[i] - want[i]).abs().max().item<double>();
  }
}

// Round robin: worker w's push s is computed on the parameters right after
// its own push s - 1, and applied after every push (s, w' < w).
// staleness_lr: the rate is divided by tau = version - base when tau > 1.
// delay_comp: DC-ASGD, g + lambda * (g * g * w_now - g * g * w_base).
inline std::vector<at::Tensor> sequential_round_robin(int workers, int64_t steps,
                                               bool staleness_lr = false, double delay_comp = 0) {
  auto global = make_params();
  auto opt = make_opt("sgd", global);
  std::vector<std::vector<at::Tensor>> seen(workers);
  for (auto& v : seen) v = clone_params(global);
  std::vector<int64_t> base(workers, 0);
  auto scratch = clone_params(global);
  int64_t version = 0;
  for (int64_t s = 0; s < steps; ++s) {
    for (int w = 0; w < workers; ++w) {
      copy_params(scratch, seen[w]);
      compute_grads(scratch, w, s);
      for (size_t i = 0; i < global.size(); ++i) {
        const at::Tensor g = scratch[i].grad();
        global[i].mutable_grad() =
            delay_comp > 0
                ? g + (g * g * global[i].detach() - g * g * seen[w][i].detach()) * delay_comp
                : g;
      }
      const int64_t tau = version - base[w];
      const double scale = staleness_lr && tau > 1 ? 1.0 / static_cast<double>(tau) : 1.0;
      set_lr(*opt, lr_at(version++) * scale);
      opt->step();
      copy_params(seen[w], global);
      base[w] = version;
    }
  }
  return global;
}

// A codec spec as a GoogleTest parameter name ("int8:16" -> "int8_16").
inline std::string codec_test_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string s = info.param;
  for (char& c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return s;
}

// ssp:S for S = 0, 1 and N - 1, worker 0 up to 4 ms slower per step than
// the others: a worker is given the parameters for its step s only once
// every live worker has pushed at least s - S times, so (server 0's shard)
// the version it gets is at least s + (N - 1)(s - S); and no applied
// gradient is more than (2N - 1) S + N - 1 versions stale; with S = N - 1
// none more than S. servers: K, or ps::kColocated.
inline void expect_ssp_bounds(int servers, int workers, int64_t steps = 30) {
  const int k = servers == ps::kColocated ? world_size() : servers;
  for (int64_t S : {int64_t{0}, int64_t{1}, int64_t{workers - 1}}) {
    SCOPED_TRACE(::testing::Message() << "ssp:" << S);
    std::mt19937 rng(7 + world_size() + ddpx::comm::detail::MpiEnv::get().world_rank());
    const auto got = run_ps(
        options(servers, "ssp:" + std::to_string(S)), steps,
        [&](int w, int64_t) {
          if (w == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 4000));
        },
        "", {}, {},
        [&](ps::Worker& worker, int w, int64_t s) {
          EXPECT_GE(worker.version(), s + (workers - 1) * (s - S)) << "worker " << w << ", step " << s;
        });
    EXPECT_EQ(got.stats.applied, k * workers * steps);  // every push reaches every server
    EXPECT_LE(got.stats.staleness.max(), (2 * workers - 1) * S + workers - 1);
    if (S >= workers - 1) EXPECT_LE(got.stats.staleness.max(), S);  // pushes held too
  }
}

}  // namespace ddpx::test::ps_util
