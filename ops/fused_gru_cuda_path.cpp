#include "ops/fused_gru_cuda_path.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace ddpx::detail {

GruCudaPath gru_cuda_path_choice() {
  const char* env = std::getenv("DDPX_GRU_PATH");
  const bool unset = env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0;
  if (unset) {
    // torch.backends.cudnn.benchmark: "measure for my shapes", which then
    // covers cuDNN against ours too (as for tiled_conv2d).
    return at::globalContext().benchmarkCuDNN() ? GruCudaPath::kBenchmark : GruCudaPath::kAuto;
  }
  if (std::strcmp(env, "cudnn") == 0) return GruCudaPath::kCudnn;
  if (std::strcmp(env, "step") == 0) return GruCudaPath::kStep;
  if (std::strcmp(env, "benchmark") == 0) return GruCudaPath::kBenchmark;
  TORCH_CHECK(std::strcmp(env, "fused") == 0,
              "DDPX_GRU_PATH must be one of auto, cudnn, fused, step, benchmark; got '", env, "'");
  return GruCudaPath::kFused;
}

namespace {
std::atomic<bool (*)(c10::Device)> capture_query{nullptr};
std::atomic<bool (*)(int, int64_t, int64_t, c10::ScalarType)> persistent_query{nullptr};
}  // namespace

bool gru_persistent_beats_cudnn(int64_t hidden, int64_t batch, int64_t steps,
                                c10::ScalarType dtype, bool tf32) {
  if (dtype != at::kFloat || hidden < 128 || batch < 1 || steps < 16) return false;
  if (batch <= 4) return true;
  return !tf32 && batch <= 16 && hidden <= 512;
}

GruCudaPath gru_auto_path(const at::Tensor& input, int64_t hidden, bool batch_first) {
  if (input.dim() != 2 && input.dim() != 3) return GruCudaPath::kCudnn;  // (at::gru says why)
  const int64_t batch = input.dim() == 2 ? 1 : input.size(batch_first ? 0 : 1);
  const int64_t steps = input.dim() == 2 ? input.size(0) : input.size(batch_first ? 1 : 0);
  // (asked for the RNN op: without one, the getter throws once conv's and
  // RNN's flags differ)
  const bool tf32 = at::globalContext().allowTF32CuDNN(at::Float32Op::RNN);
  if (!gru_persistent_beats_cudnn(hidden, batch, steps, input.scalar_type(), tf32)) {
    return GruCudaPath::kCudnn;
  }
  auto* fits = persistent_query.load();
  const bool ours = fits != nullptr && input.numel() > 0 &&
                    fits(input.get_device(), hidden, batch, input.scalar_type());
  return ours ? GruCudaPath::kFused : GruCudaPath::kCudnn;
}

void set_gru_persistent_query(bool (*query)(int, int64_t, int64_t, c10::ScalarType)) {
  persistent_query.store(query);
}

bool gru_stream_capturing(c10::Device device) {
  bool (*query)(c10::Device) = capture_query.load();
  return query != nullptr && query(device);
}

void set_gru_stream_capture_query(bool (*query)(c10::Device)) { capture_query.store(query); }

std::tuple<at::Tensor, at::Tensor> gru_through_cudnn(const at::Tensor& input,
                                                     const std::optional<at::Tensor>& hx,
                                                     at::TensorList params, bool has_biases,
                                                     int64_t num_layers, double dropout, bool train,
                                                     bool bidirectional, bool batch_first) {
  TORCH_CHECK(input.dim() == 2 || input.dim() == 3,
              "input must be 2-D [seq, input_size] (unbatched) or 3-D, got ", input.dim(), "-D");
  TORCH_CHECK(params.size() >= 2, "params must hold w_ih and w_hh of every layer, got ",
              params.size(), " tensors");
  const bool unbatched = input.dim() == 2;
  const at::Tensor x = unbatched ? input.unsqueeze(batch_first ? 0 : 1) : input;
  const int64_t batch = x.size(batch_first ? 0 : 1);
  const int64_t hidden = params[1].size(1);  // w_hh_l0: [3 * hidden, hidden]
  const int64_t states = num_layers * (bidirectional ? 2 : 1);
  at::Tensor h0;
  if (hx.has_value() && hx->defined()) {
    h0 = unbatched ? hx->unsqueeze(1) : *hx;
  } else {
    h0 = at::zeros({states, batch, hidden}, x.options());
  }
  auto [y, h_n] =
      at::gru(x, h0, params, has_biases, num_layers, dropout, train, bidirectional, batch_first);
  if (unbatched) return {y.squeeze(batch_first ? 0 : 1), h_n.squeeze(1)};
  return {y, h_n};
}

}  // namespace ddpx::detail
