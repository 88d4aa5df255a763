#include "plugin/trainer/model.h"

#include <filesystem>

namespace ddpx::trainer {
namespace {

int64_t int_attr(const torch::jit::Module& m, const std::string& path, const char* name) {
  TORCH_CHECK(m.hasattr(name) && m.attr(name).isInt(), "ddpx-train: model ", path,
              " has no int attribute '", name, "' (export it with scripts/export_models.py)");
  return m.attr(name).toInt();
}

}  // namespace

ScriptedModel load_model(const std::string& path) {
  TORCH_CHECK(std::filesystem::is_regular_file(path), "ddpx-train: model file '", path,
              "' does not exist (build the models: scripts/setup.sh exports them to "
              "build/torchscript_models/)");
  ScriptedModel out;
  try {
    out.module = torch::jit::load(path);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "ddpx-train: cannot load model '", path, "' as TorchScript: ",
                e.what_without_backtrace());
  }
  const auto& m = out.module;
  TORCH_CHECK(m.find_method("forward").has_value(), "ddpx-train: model ", path,
              " has no forward() method; ddpx-train calls forward(x) -> logits");
  TORCH_CHECK(m.hasattr("ddpx_input") && m.attr("ddpx_input").isString(), "ddpx-train: model ",
              path, " has no str attribute 'ddpx_input' (export it with scripts/export_models.py)");
  out.input = m.attr("ddpx_input").toStringRef();
  TORCH_CHECK(out.input == "image" || out.input == "tokens", "ddpx-train: model ", path,
              " has ddpx_input '", out.input, "'; ddpx-train feeds 'image' or 'tokens'");
  out.num_classes = int_attr(m, path, "num_classes");
  if (out.input == "tokens") {
    out.doc.vocab = int_attr(m, path, "vocab_size");
    out.doc.sentences = int_attr(m, path, "sentences");
    out.doc.words = int_attr(m, path, "words");
    out.doc.classes = out.num_classes;
  } else {
    TORCH_CHECK(out.num_classes == 10, "ddpx-train: image model ", path, " has ",
                out.num_classes, " classes; MNIST-style data has 10");
  }
  return out;
}

}  // namespace ddpx::trainer
