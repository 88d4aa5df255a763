// GradSync's hook profiler under mpirun (2 and 3 ranks): the merged trace
// holds every phase of every bucket of exactly the traced steps, with
// consistent timestamps; the summary agrees with the trace; the window, the
// off switch and an unwritable path behave; the phases are RecordFunction
// ranges that a torch profiler callback sees, on the channel threads too.
#include <ATen/record_function.h>
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>

#include "mpi_test_util.h"

namespace {

using ddpx::GradSync;
using ddpx::GradSyncOptions;
using nlohmann::json;

ddpx::comm::ProcessGroupPtr& world() { return ddpx::test::world_pg(); }

// Same path on every rank (rank 0 writes it); one per world size, since the
// 2- and 3-rank runs may run at once.
std::string trace_path(const std::string& name) {
  const char* dir = std::getenv("DDPX_TEST_TMP");
  std::filesystem::path d = dir ? dir : std::filesystem::temp_directory_path().string();
  return (d / ("profiler_" + name + "_np" + std::to_string(world()->getSize()) + ".json")).string();
}

void barrier() {
  std::vector<at::Tensor> t{at::zeros({1})};
  world()->allreduce(t)->wait();
}

struct NetImpl : torch::nn::Module {
  std::vector<torch::nn::Linear> layers;
  NetImpl() {
    for (int i = 0; i < 6; ++i) {
      layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(16, 16)));
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& l : layers) x = torch::tanh(l(x));
    return x.pow(2).mean();
  }
};
TORCH_MODULE(Net);

// Tiny buckets (several per step) over two channels.
GradSyncOptions small_buckets() {
  GradSyncOptions o;
  o.bucket_cap_mb(0.002).first_bucket_mb(0.001);
  return o;
}

// `steps` training steps with the optimizer step as a traced phase.
void train(Net& m, GradSync& sync, int steps) {
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.01));
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    m(at::randn({4, 16}) * (world()->getRank() + 1)).backward();
    auto g = sync.phase("optimizer_step");
    opt.step();
  }
}

json read_trace(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << "no trace at " << path;
  return json::parse(f);
}

// Events of one rank and step, by name (names of per-bucket events carry
// the bucket: "ddpx::allreduce[bucket2]").
std::multimap<std::string, json> events_of(const json& trace, int pid, int step) {
  std::multimap<std::string, json> out;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "M" || e["pid"] != pid) continue;
    if (e["args"]["step"].get<double>() == step) out.emplace(e["name"].get<std::string>(), e);
  }
  return out;
}

std::set<int> traced_steps(const json& trace) {
  std::set<int> s;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "M") s.insert(static_cast<int>(e["args"]["step"].get<double>()));
  }
  return s;
}

const json& one(const std::multimap<std::string, json>& ev, const std::string& name) {
  EXPECT_EQ(ev.count(name), 1u) << name;
  static const json missing = {{"ts", -1.0}, {"dur", -1.0}, {"args", json::object()}};
  auto it = ev.find(name);
  return it == ev.end() ? missing : it->second;
}

double end_of(const json& e) { return e["ts"].get<double>() + e["dur"].get<double>(); }

constexpr double kEps = 0.01;  // us: timestamps are written with ns resolution

// Every phase of every bucket of `step` on every rank, in a consistent order.
void expect_complete_step(const json& trace, int step, int buckets) {
  for (int pid = 0; pid < world()->getSize(); ++pid) {
    SCOPED_TRACE("rank " + std::to_string(pid) + " step " + std::to_string(step));
    auto ev = events_of(trace, pid, step);
    const auto &bw = one(ev, "ddpx::backward"), &fc = one(ev, "ddpx::final_callback"),
               &fw = one(ev, "ddpx::final_wait"), &wb = one(ev, "ddpx::write_back"),
               &opt = one(ev, "ddpx::optimizer_step");
    one(ev, "ddpx::step_stats");
    const auto& agree = one(ev, "ddpx::step_agreement");  // after every bucket, on channel 0
    EXPECT_EQ(agree["tid"], 1000);
    EXPECT_GE(agree["ts"].get<double>(), fc["ts"].get<double>() - kEps);
    EXPECT_LE(end_of(agree), end_of(fw) + kEps);
    EXPECT_LE(end_of(bw), fc["ts"].get<double>() + kEps);
    EXPECT_GE(fw["ts"].get<double>(), fc["ts"].get<double>() - kEps);
    EXPECT_LE(end_of(fw), wb["ts"].get<double>() + kEps);
    EXPECT_LE(end_of(wb), end_of(fc) + kEps);
    EXPECT_GE(opt["ts"].get<double>(), end_of(fc) - kEps);
    for (int b = 0; b < buckets; ++b) {
      const std::string tag = "[bucket" + std::to_string(b) + "]";
      const auto& hooks = one(ev, "ddpx::hooks" + tag);
      const auto& ready = one(ev, "ddpx::ready" + tag);
      const auto& launch = one(ev, "ddpx::launch" + tag);
      const auto& run = one(ev, "ddpx::allreduce" + tag);
      EXPECT_GE(hooks["args"]["calls"].get<double>(), 1);
      EXPECT_LE(end_of(hooks),
                fc["ts"].get<double>() + kEps);  // hooks end before the final callback
      const double r = ready["ts"].get<double>(), l = launch["ts"].get<double>(),
                   c = run["args"]["complete"].get<double>();
      EXPECT_NEAR(run["args"]["ready"].get<double>(), r, kEps);
      EXPECT_NEAR(run["args"]["launch"].get<double>(), l, kEps);
      EXPECT_GE(l, r - kEps) << tag;
      EXPECT_GE(run["ts"].get<double>(), l - kEps) << tag;  // runs after its launch
      EXPECT_GE(c, end_of(run) - kEps) << tag;
      EXPECT_LE(c, end_of(fw) + kEps) << tag;  // the final wait saw it complete
      EXPECT_EQ(run["tid"], launch["tid"]);    // the bucket's channel track
      EXPECT_EQ(run["tid"], ready["tid"]);
      // (Channel 0, any lane: runs in flight together sit on 1000, 1100, ...)
      if ((run["tid"].get<int>() - 1000) % 100 == 0) {
        EXPECT_GE(agree["ts"].get<double>(), end_of(run) - kEps) << tag;
      }
    }
    // encode -> wire -> decode inside each bucket's run: 3 per bucket.
    EXPECT_EQ(ev.count("ddpx::encode"), static_cast<size_t>(buckets));
    EXPECT_EQ(ev.count("ddpx::wire"), static_cast<size_t>(buckets));
    EXPECT_EQ(ev.count("ddpx::decode"), static_cast<size_t>(buckets));
  }
}

TEST(Profiler, WindowedTraceHoldsEveryPhaseOfEveryBucket) {
  const auto path = trace_path("window");
  std::filesystem::remove(path);
  barrier();
  torch::manual_seed(1);
  Net m;
  auto o = small_buckets().trace(path).trace_steps("2:4");
  o.channels.push_back(ddpx::comm::make("ddpx_mpi"));
  GradSync sync(m->named_parameters(), world(), o);
  const int buckets = static_cast<int>(sync.bucket_plan().size());
  ASSERT_GE(buckets, 3);
  train(m, sync, 5);  // step 5 ends the window: the trace is written then
  barrier();
  if (world()->getRank() == 0) {
    const json t = read_trace(path);
    EXPECT_EQ(traced_steps(t), (std::set<int>{2, 3, 4}));
    EXPECT_EQ(t["otherData"]["ranks_gathered"], world()->getSize());
    for (int step = 2; step <= 4; ++step) expect_complete_step(t, step, buckets);
  }
  barrier();
  sync.flush_trace();  // no-op: already written
}

// The summary's medians equal those computed from the trace's spans.
TEST(Profiler, SummaryAgreesWithTheTrace) {
  const auto path = trace_path("summary");
  torch::manual_seed(2);
  Net m;
  GradSync sync(m->named_parameters(), world(), small_buckets().trace(path).trace_steps("1:"));
  const int steps = 7;
  train(m, sync, steps);
  const auto s = sync.profile();
  sync.flush_trace();
  barrier();
  EXPECT_EQ(s.steps, steps);
  EXPECT_EQ(s.params, 12);
  if (world()->getRank() != 0) return;
  const json t = read_trace(path);
  std::vector<double> bw, exposed, comm, per_param, sent, eff;
  for (int step = 1; step <= steps; ++step) {
    auto ev = events_of(t, 0, step);
    bw.push_back(one(ev, "ddpx::backward")["dur"].get<double>());
    exposed.push_back(one(ev, "ddpx::final_callback")["dur"].get<double>());
    double cpu = 0, calls = 0;
    std::vector<std::pair<double, double>> inflight;  // launch -> complete per bucket
    for (const auto& [name, e] : ev) {
      if (name.rfind("ddpx::allreduce[", 0) == 0) {
        inflight.emplace_back(e["args"]["launch"].get<double>(),
                              e["args"]["complete"].get<double>());
      }
      if (name.rfind("ddpx::hooks[", 0) == 0) {
        cpu += e["args"]["cpu_us"].get<double>();
        calls += e["args"]["calls"].get<double>();
      }
    }
    // Communication: the wall time covered by at least one bucket in flight.
    std::sort(inflight.begin(), inflight.end());
    double c = 0, covered = 0;
    for (const auto& [a, e] : inflight) {
      if (e <= covered) continue;
      c += e - std::max(a, covered);
      covered = e;
    }
    comm.push_back(c);
    per_param.push_back(cpu / calls);
    eff.push_back(1 - exposed.back() / c);
    sent.push_back(one(ev, "ddpx::step_stats")["args"]["bytes_sent"].get<double>());
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  EXPECT_NEAR(s.backward_us, median(bw), 0.01);
  EXPECT_NEAR(s.exposed_comm_us, median(exposed), 0.01);
  EXPECT_NEAR(s.comm_us, median(comm), 0.05);
  EXPECT_NEAR(s.hook_cpu_per_param_us, median(per_param), 0.01);
  EXPECT_NEAR(s.overlap_efficiency, median(eff), 1e-3);
  // float32 buckets, codec none: every parameter's 4 bytes go on the wire.
  EXPECT_EQ(s.bytes_sent, median(sent));
  EXPECT_EQ(s.bytes_sent, 4.0 * (6 * (16 * 16 + 16)));
  EXPECT_EQ(s.compression, 1.0);
  const auto table = sync.profile_summary();
  for (const char* row : {"compute (backward)", "exposed communication", "overlap efficiency",
                          "hook CPU per parameter tensor", "compression ratio",
                          "re-planning events", "unused mispredictions"}) {
    EXPECT_NE(table.find(row), std::string::npos) << row << "\n" << table;
  }
}

TEST(Profiler, CodecBytesAndCompressionInTheSummary) {
  const auto path = trace_path("fp16");
  torch::manual_seed(3);
  Net m;
  GradSync sync(m->named_parameters(), world(),
                small_buckets().codec("fp16").trace(path).trace_steps("1:2"));
  train(m, sync, 3);  // step 3 flushes
  const auto s = sync.profile();
  // 2 bytes per element plus the codec's 96-byte agreement per bucket.
  const double elems = 6 * (16 * 16 + 16);
  const double agreement = 96.0 * static_cast<double>(sync.bucket_plan().size());
  EXPECT_EQ(s.bytes_sent, 2 * elems + agreement);
  EXPECT_NEAR(s.compression, 4 * elems / (2 * elems + agreement), 1e-9);
  barrier();
  if (world()->getRank() == 0) {
    const json t = read_trace(path);
    EXPECT_EQ(traced_steps(t), (std::set<int>{1, 2}));
    expect_complete_step(t, 2, static_cast<int>(sync.bucket_plan().size()));
  }
}

// Sharded, a bucket's gather (after its step) is a span of its own on the
// bucket's channel track, after its reduction's, each with its wire span.
// Overlap::None: each bucket is stepped and gathered behind its reduction,
// during backward, so every gather ends before the step-end agreement
// (queued at the end of backward on the same channel) begins.
TEST(Profiler, ShardedBucketsTraceTheirGatherApartFromTheirReduction) {
  const auto path = trace_path("shard");
  torch::manual_seed(4);
  Net m;
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.01));
  GradSync sync(m->named_parameters(), world(),
                small_buckets().shard(ddpx::Shard::Optimizer).trace(path).trace_steps("1:2"));
  sync.set_optimizer(opt);
  for (int step = 0; step < 3; ++step) {  // step 3 flushes
    m(at::randn({4, 16}) * (world()->getRank() + 1)).backward();
  }
  const int buckets = static_cast<int>(sync.bucket_plan().size());
  // The step's stats time each gather too, after its reduction, and count
  // it as communication.
  const ddpx::StepStats& last = sync.last_step();
  double on_wire = 0;
  for (const auto& b : last.buckets) {
    EXPECT_GE(b.gather_us, b.complete_us - kEps) << "bucket " << b.index;
    EXPECT_GE(b.gathered_us, b.gather_us) << "bucket " << b.index;
    on_wire += (b.complete_us - b.launch_us) + (b.gathered_us - b.gather_us);
  }
  EXPECT_NEAR(last.comm_us, on_wire, 1e-6);
  barrier();
  if (world()->getRank() == 0) {
    const json t = read_trace(path);
    for (int pid = 0; pid < world()->getSize(); ++pid) {
      SCOPED_TRACE("rank " + std::to_string(pid));
      auto ev = events_of(t, pid, 2);
      for (int b = 0; b < buckets; ++b) {
        const std::string tag = "[bucket" + std::to_string(b) + "]";
        const auto& run = one(ev, "ddpx::allreduce" + tag);
        const auto& gather = one(ev, "ddpx::gather" + tag);
        EXPECT_EQ(gather["tid"], run["tid"]) << tag;
        EXPECT_GE(gather["ts"].get<double>(), end_of(run) - kEps) << tag;
        EXPECT_LE(run["args"]["complete"].get<double>(), gather["ts"].get<double>() + kEps);
        EXPECT_LE(end_of(gather), one(ev, "ddpx::step_agreement")["ts"].get<double>() + kEps)
            << tag << ": gathered after the step-end agreement, not during backward";
      }
      EXPECT_EQ(ev.count("ddpx::wire"), static_cast<size_t>(2 * buckets));
    }
  }
}

TEST(Profiler, OffWritesNothingAndStillSummarises) {
  const auto path = trace_path("off");
  std::filesystem::remove(path);
  barrier();
  ASSERT_EQ(std::getenv("DDPX_TRACE"), nullptr);
  torch::manual_seed(4);
  Net m;
  {
    GradSync sync(m->named_parameters(), world(), small_buckets());
    train(m, sync, 3);
    sync.flush_trace();
    EXPECT_EQ(sync.profile().steps, 3);
    EXPECT_GT(sync.profile().backward_us, 0);
  }
  barrier();
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(Profiler, EnvironmentTurnsTracingOnWithItsWindow) {
  const auto path = trace_path("env");
  setenv("DDPX_TRACE", path.c_str(), 1);
  setenv("DDPX_TRACE_STEPS", "3:", 1);
  torch::manual_seed(5);
  Net m;
  {
    GradSync sync(m->named_parameters(), world(), small_buckets());
    train(m, sync, 4);
  }  // the destructor writes the trace (every rank destroys it here)
  unsetenv("DDPX_TRACE");
  unsetenv("DDPX_TRACE_STEPS");
  barrier();
  if (world()->getRank() == 0) EXPECT_EQ(traced_steps(read_trace(path)), (std::set<int>{3, 4}));
}

// After a failed step a peer may be gone: the destructor must not wait on
// it. Rank 0 writes its own events only (ranks_gathered 1).
TEST(Profiler, DestructorAfterAFailedStepDoesNotGather) {
  const auto path = trace_path("failed");
  torch::manual_seed(8);
  Net m;
  {
    GradSync sync(m->named_parameters(), world(),
                  small_buckets().unused(ddpx::Unused::Off).trace(path));
    train(m, sync, 1);
    // Only the first layer gets a gradient: every rank raises at the end of
    // backward (Unused::Off), so nobody is left waiting in a collective.
    EXPECT_THROW(torch::tanh(m->layers[0](at::randn({4, 16}))).pow(2).mean().backward(),
                 c10::Error);
  }
  barrier();
  if (world()->getRank() == 0) {
    const json t = read_trace(path);
    EXPECT_EQ(t["otherData"]["ranks_gathered"], 1);
    EXPECT_EQ(traced_steps(t), (std::set<int>{1}));
    for (const auto& e : t["traceEvents"]) EXPECT_EQ(e["pid"], 0);
  }
}

TEST(Profiler, UnwritablePathIsAnErrorAtConstruction) {
  torch::manual_seed(6);
  Net m;
  try {
    GradSync sync(m->named_parameters(), world(),
                  GradSyncOptions().trace("/nonexistent-ddpx-dir/trace.json"));
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cannot write the trace file '/nonexistent-ddpx-dir/trace.json'"),
              std::string::npos)
        << msg;
  }
}

TEST(Profiler, BadWindowNamesTheOption) {
  Net m;
  for (const char* bad : {"5:2", "x:3", "0:4", "7"}) {
    try {
      GradSync sync(m->named_parameters(), world(), GradSyncOptions().trace("t").trace_steps(bad));
      ADD_FAILURE() << "no error for " << bad;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("trace_steps"), std::string::npos) << e.what();
    }
  }
}

// A thread-local RecordFunction callback, as torch.profiler installs, sees
// every ddpx range, including those on the channel threads.
TEST(Profiler, PhasesAreRecordFunctionRanges) {
  static std::mutex mu;
  static std::set<std::string> seen;
  auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback([](const at::RecordFunction& fn)
                                     -> std::unique_ptr<at::ObserverContext> {
        std::string name = fn.name();
        if (name.rfind("ddpx::", 0) == 0) {
          std::lock_guard<std::mutex> lock(mu);
          seen.insert(name);
        }
        return nullptr;
      }).scopes({at::RecordScope::USER_SCOPE}));
  torch::manual_seed(7);
  Net m;
  GradSync sync(m->named_parameters(), world(), small_buckets().codec("bf16"));
  train(m, sync, 1);
  at::removeCallback(handle);
  for (const char* name :
       {"ddpx::hook", "ddpx::bucket_launch", "ddpx::allreduce[bucket0]", "ddpx::allreduce[bucket2]",
        "ddpx::codec_wire", "ddpx::final_callback", "ddpx::final_wait", "ddpx::optimizer_step"}) {
    EXPECT_EQ(seen.count(name), 1u) << name;
  }
}

}  // namespace
