// GradSync's modes with CUDA parameters (label gpu; mpirun -np 2, both ranks
// on the one GPU): every overlap mode (per-bucket optimizer on streams, gated
// next forward, priority, one step stale), codecs (fp16, the int8 CUDA
// kernels, top-k), unused parameters (predicted and exact) and a checkpoint
// resumed in the middle must leave the parameters bit for bit where the
// synchronous path on the same device leaves them (the CPU suites' check,
// tests/cpp/test_grad_sync_overlap.cpp, on CUDA), over ddpx_mpi (CUDA tensors
// staged through host memory) and Gloo; and NCCL at world size 1 (one GPU
// cannot hold two NCCL ranks) through the same code path. Sharded runs
// (GradSyncOptions::shard) too, against the unsharded synchronous path. And
// the staging of CUDA buckets through pinned host memory in many chunks
// against the backend's own path.
#include <ddpx/comm.h>
#include <ddpx/grad_sync.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <string>

#include "grad_sync_train_harness.h"
#include "mpi_test_util.h"
#include "plugin/comm/backend_registry.h"

namespace {

using namespace ddpx_overlap_test;

struct CudaCase {
  const char* name;
  TrainRun run;
  const char* backend;  // "" : world() (ddpx_mpi under mpirun); "gloo"
};
void PrintTo(const CudaCase& c, std::ostream* os) { *os << c.name; }

ddpx::comm::ProcessGroupPtr gloo_group() {
  static auto pg = ddpx::comm::make("gloo", [] {
    ddpx::comm::MakeOptions o;
    o.name = "cuda_modes_gloo";
    return o;
  }());
  return pg;
}

TrainRun on_cuda(TrainRun r, int staleness = 0, int warmup = 0) {
  r.device = at::Device(at::kCUDA, 0);
  r.steps = 130;  // past both learning-rate drops (set_lr)
  r.staleness = staleness;
  r.warmup = warmup;
  return r;
}

using ddpx::Shard;

// A sharded run; a codec's on the model whose every parameter is used (with
// unused ones it parts from the unsharded codec in the last bits:
// test_grad_sync_shard.cpp).
TrainRun sharded_run(Shard s, Overlap o, Opt opt, int micro = 1, const char* codec = "none") {
  TrainRun r = with(o, opt, Unused::Predict, micro, codec);
  r.shard = s;
  r.every_param_used = std::string(codec) != "none";
  return r;
}

class GradSyncCudaModes : public ::testing::TestWithParam<CudaCase> {};

TEST_P(GradSyncCudaModes, BitwiseEqualToTheSynchronousPathOnTheGpu) {
  DDPX_SKIP_WITHOUT_GPU();
  TrainRun ours = GetParam().run;
  if (std::string(GetParam().backend) == "gloo") ours.group = gloo_group();
  expect_same_as_synchronous(ours, GetParam().name);
}

constexpr Unused kPredict = Unused::Predict;
const CudaCase kCudaCases[] = {
    {"OptimizerSgdNesterov", on_cuda(with(Overlap::Optimizer, Opt::SgdNesterov)), ""},
    {"NextForwardAdamW", on_cuda(with(Overlap::NextForward, Opt::AdamW)), ""},
    {"NextForwardAdamExactUnused", on_cuda(with(Overlap::NextForward, Opt::Adam, Unused::Exact)), ""},
    {"NextForwardNoSync", on_cuda(with(Overlap::NextForward, Opt::SgdNesterov, kPredict, 2)), ""},
    {"NextForwardCodecFp16", on_cuda(with(Overlap::NextForward, Opt::AdamW, kPredict, 1, "fp16")), ""},
    {"OptimizerCodecInt8", on_cuda(with(Overlap::Optimizer, Opt::AdamW, kPredict, 1, "int8")), ""},
    {"OptimizerCodecTopk", on_cuda(with(Overlap::Optimizer, Opt::SgdNesterov, kPredict, 1, "topk:0.3")), ""},
    {"StaleOneStep", on_cuda(with(Overlap::Optimizer, Opt::AdamW), 1, 2), ""},
    {"NextForwardResumed", on_cuda(with(Overlap::NextForward, Opt::AdamW, kPredict, 1, "none", 85)), ""},
    {"GlooOptimizerAdamW", on_cuda(with(Overlap::Optimizer, Opt::AdamW)), "gloo"},
    {"GlooNextForwardCodecInt8", on_cuda(with(Overlap::NextForward, Opt::SgdNesterov, kPredict, 1, "int8")), "gloo"},
    // GradSyncOptions::shard (ZeRO-1/2): the reduce to the owners, the
    // owned step and the gather on the channels' streams.
    {"ShardOptimizerStateNoOverlap", on_cuda(sharded_run(Shard::Optimizer, Overlap::None, Opt::AdamW)), ""},
    {"ShardGradientsNextForwardNoSync",
     on_cuda(sharded_run(Shard::Gradients, Overlap::NextForward, Opt::SgdNesterov, 2)), ""},
    {"ShardGradientsCodecFp16", on_cuda(sharded_run(Shard::Gradients, Overlap::Optimizer, Opt::Adam, 1, "fp16")), ""},
    {"GlooShardGradientsOptimizer", on_cuda(sharded_run(Shard::Gradients, Overlap::Optimizer, Opt::AdamW)), "gloo"},
};

INSTANTIATE_TEST_SUITE_P(Cuda, GradSyncCudaModes, ::testing::ValuesIn(kCudaCases),
                         [](const auto& info) { return std::string(info.param.name); });

// GradSyncOptions::stage_chunk_bytes: buckets staged through pinned host
// memory in chunks of 64 bytes (dozens a bucket: plugin/comm/host_stage.h's
// pipeline) land bit for bit where the backend's own path (0: the bucket
// handed over, which ddpx_mpi and Gloo stage whole) does, synchronous and
// overlapped. Both backends reduce host memory only here.
TEST(GradSyncCudaStaging, ManySmallChunksEqualTheBackendsOwnPath) {
  DDPX_SKIP_WITHOUT_GPU();
  for (const std::string backend : {"ddpx_mpi", "gloo"}) {
    const auto group = backend == "gloo" ? gloo_group() : world();
    EXPECT_TRUE(ddpx::comm::detail::stages_through_host(*group, c10::DeviceType::CUDA)) << backend;
    for (auto overlap : {Overlap::None, Overlap::NextForward}) {
      TrainRun staged = on_cuda(with(overlap, Opt::AdamW));
      staged.group = group;
      staged.steps = 40;
      staged.stage_chunk_bytes = 64;
      TrainRun whole = staged;
      whole.stage_chunk_bytes = 0;
      expect_bitwise(train(staged), train(whole),
                     backend + (overlap == Overlap::None ? " synchronous" : " next forward"));
    }
  }
}

// NCCL at world size 1 (each rank its own group on a HashStore): the same
// code path, per-bucket optimizer and gated forward against the synchronous
// path.
TEST(GradSyncCudaNccl, WorldSizeOneMatchesTheSynchronousPath) {
  DDPX_SKIP_WITHOUT_GPU();
  ddpx::comm::MakeOptions o;
  o.store = c10::make_intrusive<c10d::HashStore>();
  o.rank = 0;
  o.size = 1;
  o.name = "nccl_ws1";
  auto pg = ddpx::comm::make("cpu:gloo,cuda:nccl", o);
  ASSERT_EQ(pg->getBackend(c10::DeviceType::CUDA)->getBackendName(), "nccl");
  EXPECT_FALSE(ddpx::comm::detail::stages_through_host(*pg, c10::DeviceType::CUDA))
      << "NCCL reduces device memory: never staged";
  for (auto overlap : {Overlap::Optimizer, Overlap::NextForward}) {
    TrainRun ours = on_cuda(with(overlap, Opt::AdamW));
    ours.group = pg;
    TrainRun ref = ours;
    ref.overlap = Overlap::None;
    expect_bitwise(train(ours), train(ref), overlap == Overlap::Optimizer ? "nccl optimizer"
                                                                          : "nccl next forward");
  }
  // Sharded over NCCL (one rank owns everything: the reduce and the gather
  // still run through NCCL's reduce and broadcast; the codec's all-to-all).
  for (const char* codec : {"none", "bf16"}) {
    TrainRun ours = on_cuda(sharded_run(Shard::Gradients, Overlap::NextForward, Opt::AdamW, 1, codec));
    ours.group = pg;
    TrainRun ref = ours;
    ref.overlap = Overlap::None;
    ref.shard = Shard::None;
    expect_bitwise(train(ours), train(ref), std::string("nccl sharded ") + codec);
  }
}

}  // namespace
