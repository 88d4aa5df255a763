#include "plugin/trainer/model.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <filesystem>
#include <string>
#include <vector>

namespace ddpx::trainer {
namespace {

int64_t int_attr(const torch::jit::Module& m, const std::string& path, const char* name) {
  TORCH_CHECK(m.hasattr(name) && m.attr(name).isInt(), "ddpx-train: model ", path,
              " has no int attribute '", name, "' (export it with scripts/export_models.py)");
  return m.attr(name).toInt();
}

// A GRU's weights in nn.GRU's _flat_weights order (per layer and direction:
// w_ih, w_hh, then b_ih, b_hh with biases).
std::vector<at::Tensor> gru_weights(const torch::jit::Module& gru, int64_t layers, bool bias,
                                    bool bidirectional) {
  std::vector<at::Tensor> w;
  for (int64_t l = 0; l < layers; ++l) {
    for (const std::string sfx : {"", "_reverse"}) {
      if (!bidirectional && !sfx.empty()) continue;
      for (const std::string n : {"weight_ih_l", "weight_hh_l", "bias_ih_l", "bias_hh_l"}) {
        if (!bias && n[0] == 'b') continue;
        const std::string name = n + std::to_string(l) + sfx;
        if (!gru.hasattr(name) || !gru.attr(name).isTensor()) return {};
        w.push_back(gru.attr(name).toTensor());
      }
    }
  }
  return w;
}

}  // namespace

void flatten_gru_weights(torch::jit::Module& model) {
  if (!at::globalContext().userEnabledCuDNN() || !at::detail::getCUDAHooks().compiledWithCuDNN()) {
    return;
  }
  for (const auto& nm : model.named_modules()) {
    const torch::jit::Module& gru = nm.value;
    if (!gru.hasattr("mode") || !gru.attr("mode").isString() ||
        gru.attr("mode").toStringRef() != "GRU") {
      continue;
    }
    const int64_t layers = gru.attr("num_layers").toInt();
    const bool bias = gru.attr("bias").toBool(), bidirectional = gru.attr("bidirectional").toBool();
    const std::vector<at::Tensor> w = gru_weights(gru, layers, bias, bidirectional);
    if (w.empty()) continue;
    // (cuDNN's dtypes as at::gru asks for them: bfloat16 too in newer torch)
    const auto dtype = w[0].scalar_type();
    bool fits = at::cudnn_is_acceptable(w[0]);
    for (const at::Tensor& t : w) {
      fits = fits && t.is_cuda() && t.device() == w[0].device() && t.scalar_type() == dtype;
    }
    if (!fits) continue;
    const at::NoGradGuard no_grad;
    at::_cudnn_rnn_flatten_weight(w, bias ? 4 : 2, gru.attr("input_size").toInt(),
                                  /*mode: cuDNN's GRU=*/3, gru.attr("hidden_size").toInt(),
                                  /*proj_size=*/0, layers, gru.attr("batch_first").toBool(),
                                  bidirectional);
  }
}

void move_model(torch::jit::Module& model, const at::Device& device) {
  model.to(device);
  if (device.is_cuda()) flatten_gru_weights(model);
}

ScriptedModel load_model(const std::string& path) {
  TORCH_CHECK(std::filesystem::is_regular_file(path), "ddpx-train: model file '", path,
              "' does not exist (build the models: scripts/setup.sh exports them to "
              "build/torchscript_models/)");
  ScriptedModel out;
  try {
    out.module = torch::jit::load(path);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "ddpx-train: cannot load model '", path,
                "' as TorchScript: ", e.what_without_backtrace());
  }
  const auto& m = out.module;
  TORCH_CHECK(m.find_method("forward").has_value(), "ddpx-train: model ", path,
              " has no forward() method; ddpx-train calls forward(x) -> logits");
  TORCH_CHECK(m.hasattr("ddpx_input") && m.attr("ddpx_input").isString(), "ddpx-train: model ",
              path, " has no str attribute 'ddpx_input' (export it with scripts/export_models.py)");
  InputSpec& s = out.spec;
  s.model = path;
  s.kind = m.attr("ddpx_input").toStringRef();
  TORCH_CHECK(s.kind == "image" || s.kind == "tokens", "ddpx-train: model ", path,
              " has ddpx_input '", s.kind, "'; ddpx-train feeds 'image' or 'tokens'");
  s.num_classes = int_attr(m, path, "num_classes");
  TORCH_CHECK(s.num_classes >= 2, "ddpx-train: model ", path, " has num_classes ", s.num_classes,
              "; a classifier needs at least 2");
  if (s.kind == "tokens") {
    s.doc.vocab = int_attr(m, path, "vocab_size");
    s.doc.sentences = int_attr(m, path, "sentences");
    s.doc.words = int_attr(m, path, "words");
    s.doc.classes = s.num_classes;
  } else if (m.hasattr("image_shape")) {
    const auto a = m.attr("image_shape");
    TORCH_CHECK(a.isIntList() && a.toIntList().size() == 3, "ddpx-train: model ", path,
                " has an attribute 'image_shape' that is not a list of 3 ints [C, H, W]");
    s.image_shape = a.toIntVector();
    for (int64_t d : s.image_shape) {
      TORCH_CHECK(d > 0, "ddpx-train: model ", path, " has image_shape with a size ", d);
    }
  }
  return out;
}

}  // namespace ddpx::trainer
