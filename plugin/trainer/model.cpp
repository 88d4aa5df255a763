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
