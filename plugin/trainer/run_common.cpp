#include "plugin/trainer/run_common.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

namespace ddpx::trainer {
namespace {

std::string default_data_cache(uint64_t seed) {
  const char* tmp = std::getenv("TMPDIR");
  return (std::filesystem::path(tmp ? tmp : "/tmp") / ("ddpx-data-v1-seed" + std::to_string(seed)))
      .string();
}

}  // namespace

void straggle(const Options& o, int rank) {
  if (rank != o.straggler_rank || o.straggler_ms <= 0) return;
  std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(o.straggler_ms));
}

int local_ranks() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE"}) {
    if (const char* s = std::getenv(v)) return std::max(1, std::atoi(s));
  }
  return 1;
}

at::Device select_device(const Options& o) {
  if (o.device == "cpu") return at::kCPU;
  const auto gpus = static_cast<int>(torch::cuda::device_count());
  TORCH_CHECK(gpus > 0,
              "ddpx-train: --device cuda, but no CUDA device is visible to this "
              "process (torch::cuda::device_count() is 0; CUDA_VISIBLE_DEVICES=",
              std::getenv("CUDA_VISIBLE_DEVICES") ? std::getenv("CUDA_VISIBLE_DEVICES") : "(unset)",
              ")");
  int local = 0;
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"}) {
    if (const char* s = std::getenv(v)) {
      local = std::max(0, std::atoi(s));
      break;
    }
  }
  const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(local % gpus));
  c10::impl::VirtualGuardImpl(at::kCUDA).setDevice(dev);
  return dev;
}

at::Tensor rows_to(const at::Tensor& all, const at::Tensor& rows, const at::Device& device) {
  if (!device.is_cuda()) return all.index_select(0, rows).to(device);
  std::vector<int64_t> sizes = all.sizes().vec();
  sizes[0] = rows.numel();
  at::Tensor pinned = at::empty(sizes, all.options().pinned_memory(true));
  at::index_select_out(pinned, all, 0, rows);
  return pinned.to(device, /*non_blocking=*/true);
}

DataSplit load_data(const Options& o, const ScriptedModel& m) {
  if (!o.data.empty()) return load_data_path(o.data, m.spec);
  if (m.spec.kind == "tokens") {
    const int64_t n = o.train_samples > 0 ? o.train_samples : 20000;
    return make_documents(m.spec.doc, n, std::max<int64_t>(n / 10, 1), o.seed);
  }
  const std::string dir = o.data_cache.empty() ? default_data_cache(o.seed) : o.data_cache;
  ensure_synthetic_images(dir, o.seed);
  return load_data_path(dir, m.spec);
}

int elastic_restart() {
  const char* s = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return s != nullptr ? std::atoi(s) : 0;
}

void injected_failure(int64_t step, int rank) {
  static const char* spec = std::getenv("DDPX_TRAIN_FAIL_AT");
  long long at_step = 0;
  int at_rank = 0;
  if (spec == nullptr || elastic_restart() > 0 ||
      std::sscanf(spec, "%lld:%d", &at_step, &at_rank) != 2 || at_step != step || at_rank != rank) {
    return;
  }
  std::cerr << "[ddpx-train] DDPX_TRAIN_FAIL_AT=" << spec << ": rank " << rank
            << " exits after step " << step << std::endl;
  std::_Exit(1);
}

void injected_stall(int64_t step, int rank) {
  static const char* spec = std::getenv("DDPX_TRAIN_STALL_AT");
  long long at_step = 0;
  int at_rank = 0;
  double seconds = 0;
  if (spec == nullptr || std::sscanf(spec, "%lld:%d:%lf", &at_step, &at_rank, &seconds) != 3 ||
      at_step != step || at_rank != rank) {
    return;
  }
  std::cerr << "[ddpx-train] DDPX_TRAIN_STALL_AT=" << spec << ": rank " << rank << " stalls "
            << seconds << " s before step " << step << std::endl;
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

void log_samples(int64_t step, int rank, int world, const at::Tensor& rows) {
  static const char* base = std::getenv("DDPX_TRAIN_SAMPLE_LOG");
  if (base == nullptr) return;
  static std::ofstream out(std::string(base) + "." + std::to_string(elastic_restart()) + "." +
                           std::to_string(rank));
  TORCH_CHECK(out, "ddpx-train: cannot write DDPX_TRAIN_SAMPLE_LOG ", base);
  const at::Tensor ids = rows.to(at::kLong).contiguous();
  const int64_t* p = ids.data_ptr<int64_t>();
  out << nlohmann::json{{"restart", elastic_restart()},
                        {"step", step},
                        {"rank", rank},
                        {"world", world},
                        {"samples", std::vector<int64_t>(p, p + ids.numel())}}
             .dump()
      << std::endl;
}

std::string eta(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", (long long)(s / 3600),
                (long long)(s / 60 % 60), (long long)(s % 60));
  return buf;
}

at::Tensor allreduce_sum(c10d::ProcessGroup& pg, at::Tensor t) {
  std::vector<at::Tensor> v{t};
  pg.allreduce(v)->wait();
  return t;
}

double evaluate(torch::jit::Module& m, const Dataset& test, int rank, int size,
                const std::function<at::Tensor(const at::Tensor&)>& sum, int64_t batch) {
  at::NoGradGuard no_grad;
  m.eval();
  at::Device dev = at::kCPU;
  at::ScalarType dtype = at::kFloat;  // (--param-dtype: floating inputs go down to it)
  for (const auto& p : m.parameters()) {
    dev = p.device();
    dtype = p.scalar_type();
    break;
  }
  const at::Tensor idx = shard_indices(test.size(), rank, size, 0, 0);
  double correct = 0;
  for (int64_t b = 0; b < idx.numel(); b += batch) {
    const at::Tensor rows = idx.narrow(0, b, std::min(batch, idx.numel() - b));
    at::Tensor x = test.inputs.index_select(0, rows).to(dev);
    if (x.is_floating_point() && (dtype == at::kBFloat16 || dtype == at::kHalf)) x = x.to(dtype);
    const at::Tensor out = m.forward({x}).toTensor();
    correct += out.argmax(1).eq(test.targets.index_select(0, rows).to(dev)).sum().item<double>();
  }
  m.train();
  const at::Tensor t = sum(at::tensor({correct, double(idx.numel())}, at::kDouble));
  return t[0].item<double>() / std::max(1.0, t[1].item<double>());
}

double evaluate(torch::jit::Module& m, const Dataset& test, c10d::ProcessGroup& pg, int64_t batch) {
  return evaluate(
      m, test, pg.getRank(), pg.getSize(),
      [&pg](const at::Tensor& t) { return allreduce_sum(pg, t); }, batch);
}

}  // namespace ddpx::trainer
