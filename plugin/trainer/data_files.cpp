// Data a user brings (--data): an idx directory or a torch.save file of a
// dict of tensors, read, checked against what the model takes, and brought
// into the form the trainer feeds (images: standardised float [N, C, H, W];
// tokens: int64 [N, S, W]; labels: int64 [N]).
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "plugin/archive_check.h"
#include "plugin/trainer/data.h"

namespace ddpx::trainer {
namespace {

namespace fs = std::filesystem;

std::string dims(c10::IntArrayRef s) {
  std::ostringstream o;
  for (size_t i = 0; i < s.size(); ++i) o << (i ? "x" : "") << s[i];
  return o.str();
}

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  TORCH_CHECK(f, "ddpx-train: cannot read ", path);
  return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}

// idx element types (the third byte of the magic number) and their sizes.
struct IdxType {
  uint8_t code;
  at::ScalarType dtype;
};
constexpr IdxType kIdxTypes[] = {{0x08, at::kByte}, {0x09, at::kChar},  {0x0B, at::kShort},
                                 {0x0C, at::kInt},  {0x0D, at::kFloat}, {0x0E, at::kDouble}};

uint32_t be32(const char* p) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  return (uint32_t(b[0]) << 24) | (uint32_t(b[1]) << 16) | (uint32_t(b[2]) << 8) | b[3];
}

bool is_integer(const at::Tensor& t) {
  return at::isIntegralType(t.scalar_type(), /*includeBool=*/false);
}

// Labels: integers, [n], each a class of the model.
at::Tensor checked_labels(const at::Tensor& y, int64_t n, const InputSpec& s,
                          const std::string& what) {
  TORCH_CHECK(is_integer(y) && y.dim() == 1, "ddpx-train: ", what, " holds labels of dtype ",
              y.scalar_type(), " and shape [", dims(y.sizes()),
              "]; labels are one integer class per sample, shape [N]");
  TORCH_CHECK(y.size(0) == n, "ddpx-train: ", what, " holds ", y.size(0), " labels for ", n,
              " samples; every sample needs one label");
  const at::Tensor labels = y.to(at::kLong).contiguous();
  const at::Tensor bad = (labels.lt(0) | labels.ge(s.num_classes)).nonzero();
  if (bad.size(0) > 0) {
    const int64_t i = bad[0][0].item<int64_t>();
    TORCH_CHECK(false, "ddpx-train: ", what, ": label ", labels[i].item<int64_t>(), " at item ", i,
                " is not a class of model ", s.model, " (0..", s.num_classes - 1, ")");
  }
  return labels;
}

// Images [N, H, W] or [N, C, H, W] whose sample shape is the model's.
at::Tensor checked_images(const at::Tensor& x, const InputSpec& s, const std::string& what) {
  TORCH_CHECK(x.dim() == 3 || x.dim() == 4, "ddpx-train: ", what, " holds a tensor of shape [",
              dims(x.sizes()), "]; images are [N, H, W] or [N, C, H, W]");
  TORCH_CHECK(is_integer(x) || at::isFloatingType(x.scalar_type()), "ddpx-train: ", what,
              " holds images of dtype ", x.scalar_type(), "; images are integers or floats");
  const at::Tensor img = x.dim() == 3 ? x.unsqueeze(1) : x;
  TORCH_CHECK(img.sizes().slice(1) == c10::IntArrayRef(s.image_shape), "ddpx-train: ", what,
              " holds images of ", dims(img.sizes().slice(1)), " (C x H x W) but model ", s.model,
              " takes ", dims(s.image_shape));
  return img;
}

at::Tensor checked_tokens(const at::Tensor& x, const InputSpec& s, const std::string& what) {
  const std::vector<int64_t> want{s.doc.sentences, s.doc.words};
  TORCH_CHECK(is_integer(x) && x.dim() == 3 && x.sizes().slice(1) == c10::IntArrayRef(want),
              "ddpx-train: ", what, " holds a tensor of dtype ", x.scalar_type(), " and shape [",
              dims(x.sizes()), "] but model ", s.model,
              " takes integer token ids of [N, sentences, words] = [N, ", dims(want), "]");
  const at::Tensor ids = x.to(at::kLong).contiguous();
  const at::Tensor bad = (ids.lt(0) | ids.ge(s.doc.vocab)).flatten().nonzero();
  if (bad.size(0) > 0) {
    const int64_t flat = bad[0][0].item<int64_t>(), per = s.doc.sentences * s.doc.words;
    TORCH_CHECK(false, "ddpx-train: ", what, ": token id ", ids.view(-1)[flat].item<int64_t>(),
                " in item ", flat / per, " is outside model ", s.model, "'s vocabulary (0..",
                s.doc.vocab - 1, ")");
  }
  return ids;
}

// Integer images: float, standardised with the training set's statistics
// (computed by one sequential pass in double, so every rank and every run
// gets the same bits); floating-point images as they are.
void standardise(Dataset& train, Dataset& test) {
  if (!is_integer(train.inputs)) {
    train.inputs = train.inputs.to(at::kFloat).contiguous();
    test.inputs = test.inputs.to(at::kFloat).contiguous();
    return;
  }
  const at::Tensor v = train.inputs.to(at::kDouble).contiguous();
  const double* p = v.const_data_ptr<double>();
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < v.numel(); ++i) sum += p[i];
  const double mean = v.numel() ? sum / double(v.numel()) : 0.0;
  for (int64_t i = 0; i < v.numel(); ++i) sq += (p[i] - mean) * (p[i] - mean);
  const double sd = v.numel() ? std::sqrt(sq / double(v.numel())) : 0.0;
  const float m = float(mean), d = sd > 0 ? float(sd) : 1.0f;
  for (Dataset* ds : {&train, &test}) ds->inputs = ds->inputs.to(at::kFloat).sub_(m).div_(d);
}

Dataset checked_split(const at::Tensor& x, const at::Tensor& y, const InputSpec& s,
                      const std::string& x_what, const std::string& y_what) {
  Dataset d;
  d.inputs = s.kind == "tokens" ? checked_tokens(x, s, x_what) : checked_images(x, s, x_what);
  d.targets = checked_labels(y, d.inputs.size(0), s, y_what);
  return d;
}

DataSplit finish(Dataset train, Dataset test, const InputSpec& s) {
  if (s.kind == "image") standardise(train, test);
  DataSplit out;
  out.train = std::move(train);
  out.test = std::move(test);
  out.num_classes = s.num_classes;
  return out;
}

// torch.save's bytes, each length checked before torch trusts it
// (archive_check.h): what torch::pickle_load does, without its reserving
// whatever a damaged file declares.
c10::IValue load_saved(const char* data, size_t size, const std::string& path) {
  const auto reader = ddpx::detail::open_torch_archive(data, size, path);
  return torch::jit::readArchiveAndTensors("data", /*pickle_prefix=*/"", /*tensor_prefix=*/"",
                                           std::nullopt, std::nullopt, std::nullopt, *reader);
}

DataSplit load_idx_dir(const std::string& dir, const InputSpec& s) {
  TORCH_CHECK(s.kind == "image", "ddpx-train: --data ", dir, " is an idx directory (images) but ",
              s.model, " is a token model; give it a torch.save file of token ids");
  std::vector<at::Tensor> t;
  std::vector<std::string> what;
  for (const char* name : kIdxFiles) {
    const fs::path path = fs::path(dir) / name;
    TORCH_CHECK(fs::exists(path), "ddpx-train: missing data file ", path.string(),
                " (an idx directory holds ", kIdxFiles[0], ", ", kIdxFiles[1], ", ", kIdxFiles[2],
                ", ", kIdxFiles[3], ")");
    t.push_back(read_idx(path.string()));
    what.push_back("idx file " + path.string());
  }
  return finish(checked_split(t[0], t[1], s, what[0], what[1]),
                checked_split(t[2], t[3], s, what[2], what[3]), s);
}

DataSplit load_saved_dict(const std::string& path, const InputSpec& s) {
  const std::vector<char> bytes = read_bytes(path);
  return parse_saved_dict(bytes.data(), bytes.size(), path, s);
}

}  // namespace

DataSplit parse_saved_dict(const char* data, size_t size, const std::string& path,
                           const InputSpec& s) {
  c10::IValue v;
  try {
    v = load_saved(data, size, path);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "ddpx-train: --data ", path,
                " is neither an idx directory nor a file written by torch.save (",
                e.what_without_backtrace(), ")");
  } catch (const std::exception& e) {  // torch's loaders also throw others (jit::ErrorReport)
    TORCH_CHECK(false, "ddpx-train: --data ", path,
                " is neither an idx directory nor a file written by torch.save (", e.what(), ")");
  }
  TORCH_CHECK(v.isGenericDict(), "ddpx-train: --data ", path, " holds a ", v.tagKind(),
              "; save a dict: torch.save({'train_x': ..., 'train_y': ..., 'test_x': ..., "
              "'test_y': ...}, path)");
  const auto dict = v.toGenericDict();
  std::ostringstream keys;
  for (const auto& kv : dict) keys << (keys.tellp() ? ", " : "") << kv.key();
  std::vector<at::Tensor> t;
  std::vector<std::string> what;
  for (const char* key : {"train_x", "train_y", "test_x", "test_y"}) {
    const auto it = dict.find(c10::IValue(std::string(key)));
    TORCH_CHECK(it != dict.end(), "ddpx-train: --data ", path, " has no key '", key,
                "' (it has: ", keys.str(), "); the dict needs train_x, train_y, test_x, test_y");
    TORCH_CHECK(it->value().isTensor(), "ddpx-train: --data ", path, ": '", key, "' holds a ",
                it->value().tagKind(), ", not a tensor");
    t.push_back(it->value().toTensor());
    what.push_back(path + " ['" + key + "']");
  }
  return finish(checked_split(t[0], t[1], s, what[0], what[1]),
                checked_split(t[2], t[3], s, what[2], what[3]), s);
}

at::Tensor parse_idx(const char* data, size_t size, const std::string& path) {
  TORCH_CHECK(size >= 4, "ddpx-train: corrupt idx file ", path, ": ", size,
              " bytes, shorter than its magic number (truncated?)");
  const uint32_t magic = be32(data);
  const auto code = static_cast<uint8_t>(magic >> 8), rank = static_cast<uint8_t>(magic);
  const IdxType* type = nullptr;
  for (const auto& it : kIdxTypes) type = it.code == code ? &it : type;
  TORCH_CHECK((magic >> 16) == 0 && type && rank >= 1 && rank <= 4, "ddpx-train: corrupt idx file ",
              path, ": magic number ", magic,
              " is not an idx header (0x0000TTDD: type TT 08, 09, "
              "0B, 0C, 0D or 0E; DD 1 to 4 dimensions; images are 2051, labels 2049)");
  const size_t header = 4 + 4 * size_t(rank);
  TORCH_CHECK(size >= header, "ddpx-train: corrupt idx file ", path, ": ", size,
              " bytes, shorter than its header (truncated?)");
  std::vector<int64_t> shape;
  uint64_t numel = 1;
  constexpr uint64_t kMaxElements = uint64_t(1) << 40;  // checked before multiplying
  for (size_t d = 0; d < rank; ++d) {
    shape.push_back(be32(data + 4 + 4 * d));
    const auto n = uint64_t(shape.back());
    TORCH_CHECK(n == 0 || numel <= kMaxElements / n, "ddpx-train: corrupt idx file ", path,
                ": its header promises [", dims(shape), "...] elements");
    numel *= n;
  }
  const size_t elem = c10::elementSize(type->dtype);
  TORCH_CHECK(size == header + numel * elem, "ddpx-train: corrupt idx file ", path, ": ", size,
              " bytes, its header promises ", header + numel * elem, " ([", dims(shape), "] of ",
              type->dtype, "; truncated?)");
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(type->dtype));
  auto* out = static_cast<char*>(t.data_ptr());
  if (numel == 0) return t;  // no storage: memcpy must not see its null pointer
  std::memcpy(out, data + header, numel * elem);
  if (elem > 1) {  // big-endian on disk
    for (uint64_t i = 0; i < numel; ++i) std::reverse(out + i * elem, out + (i + 1) * elem);
  }
  return t;
}

at::Tensor read_idx(const std::string& path) {
  const std::vector<char> bytes = read_bytes(path);
  return parse_idx(bytes.data(), bytes.size(), path);
}

DataSplit load_data_path(const std::string& path, const InputSpec& s) {
  TORCH_CHECK(fs::exists(path), "ddpx-train: --data ", path, " does not exist");
  return fs::is_directory(path) ? load_idx_dir(path, s) : load_saved_dict(path, s);
}

}  // namespace ddpx::trainer
