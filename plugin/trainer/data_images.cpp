// The image set: generation into MNIST idx files, validation, loading.
#include <c10/util/Exception.h>
#include <torch/data/datasets/mnist.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <unistd.h>

#include "plugin/trainer/data.h"

namespace ddpx::trainer {
namespace {

namespace fs = std::filesystem;
constexpr int kSide = 28, kPixels = kSide * kSide, kClasses = 10;
constexpr uint32_t kImageMagic = 2051, kLabelMagic = 2049;
constexpr uint32_t kTrainCount = 60000, kTestCount = 10000;  // fixed by LibTorch's reader

using Image = std::array<float, kPixels>;

// Three thick strokes per class at fixed random places: distinct shapes that
// a LeNet separates, but only after learning (shifts, noise and a faint
// second class's shape overlaid make it more than a template match).
std::array<Image, kClasses> make_prototypes(std::mt19937_64& rng) {
  std::array<Image, kClasses> protos{};
  std::uniform_real_distribution<float> pos(5.0f, 22.0f);
  for (auto& img : protos) {
    img.fill(0.0f);
    for (int s = 0; s < 3; ++s) {
      const float x0 = pos(rng), y0 = pos(rng), x1 = pos(rng), y1 = pos(rng);
      for (int k = 0; k <= 48; ++k) {
        const float t = k / 48.0f, cx = x0 + t * (x1 - x0), cy = y0 + t * (y1 - y0);
        for (int y = std::max(0, int(cy) - 2); y <= std::min(kSide - 1, int(cy) + 2); ++y) {
          for (int x = std::max(0, int(cx) - 2); x <= std::min(kSide - 1, int(cx) + 2); ++x) {
            const float d2 = (x - cx) * (x - cx) + (y - cy) * (y - cy);
            if (d2 <= 1.6f * 1.6f) img[y * kSide + x] = 1.0f;
          }
        }
      }
    }
  }
  return protos;
}

float at_shifted(const Image& img, int x, int y, int dx, int dy) {
  x -= dx;
  y -= dy;
  return (x < 0 || y < 0 || x >= kSide || y >= kSide) ? 0.0f : img[y * kSide + x];
}

void put_be32(std::ofstream& f, uint32_t v) {
  const char b[4] = {char(v >> 24), char(v >> 16), char(v >> 8), char(v)};
  f.write(b, 4);
}

uint32_t get_be32(std::ifstream& f) {
  unsigned char b[4] = {0, 0, 0, 0};
  f.read(reinterpret_cast<char*>(b), 4);
  return (uint32_t(b[0]) << 24) | (uint32_t(b[1]) << 16) | (uint32_t(b[2]) << 8) | b[3];
}

// Temporary name + rename: a reader never sees a half-written file.
void write_atomically(const fs::path& path, const std::vector<uint32_t>& header,
                      const std::vector<uint8_t>& body) {
  const fs::path tmp = path.string() + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(f, "ddpx-train: cannot write ", tmp.string());
    for (uint32_t v : header) put_be32(f, v);
    f.write(reinterpret_cast<const char*>(body.data()), static_cast<std::streamsize>(body.size()));
    TORCH_CHECK(f.good(), "ddpx-train: writing ", tmp.string(), " failed (disk full?)");
  }
  fs::rename(tmp, path);
}

void generate_split(std::mt19937_64& rng, const std::array<Image, kClasses>& protos,
                    uint32_t count, std::vector<uint8_t>& pixels, std::vector<uint8_t>& labels) {
  pixels.resize(size_t(count) * kPixels);
  labels.resize(count);
  std::uniform_int_distribution<int> cls(0, kClasses - 1), shift(-3, 3);
  std::uniform_real_distribution<float> gain(0.6f, 1.0f), faint(0.2f, 0.45f);
  std::normal_distribution<float> noise(0.0f, 0.2f);
  for (uint32_t i = 0; i < count; ++i) {
    const int c = cls(rng), other = (c + 1 + cls(rng) % (kClasses - 1)) % kClasses;
    const int dx = shift(rng), dy = shift(rng), ox = shift(rng), oy = shift(rng);
    const float g = gain(rng), h = faint(rng);
    labels[i] = static_cast<uint8_t>(c);
    uint8_t* out = pixels.data() + size_t(i) * kPixels;
    for (int y = 0; y < kSide; ++y) {
      for (int x = 0; x < kSide; ++x) {
        float v = g * at_shifted(protos[c], x, y, dx, dy) +
                  h * at_shifted(protos[other], x, y, ox, oy) + noise(rng);
        out[y * kSide + x] = static_cast<uint8_t>(std::lround(std::clamp(v, 0.0f, 1.0f) * 255));
      }
    }
  }
}

bool idx_files_valid(const std::string& dir) {
  try {
    check_idx_files(dir);
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

}  // namespace

void ensure_synthetic_images(const std::string& dir, uint64_t seed) {
  if (idx_files_valid(dir)) return;
  fs::create_directories(dir);
  std::mt19937_64 rng(seed);
  const auto protos = make_prototypes(rng);
  std::vector<uint8_t> pixels, labels;
  const std::pair<uint32_t, int> splits[] = {{kTrainCount, 0}, {kTestCount, 2}};
  for (const auto& [count, file] : splits) {
    generate_split(rng, protos, count, pixels, labels);
    write_atomically(fs::path(dir) / kIdxFiles[file], {kImageMagic, count, kSide, kSide}, pixels);
    write_atomically(fs::path(dir) / kIdxFiles[file + 1], {kLabelMagic, count}, labels);
  }
}

void check_idx_files(const std::string& dir) {
  TORCH_CHECK(fs::is_directory(dir), "ddpx-train: data directory '", dir, "' does not exist");
  for (int i = 0; i < 4; ++i) {
    const fs::path path = fs::path(dir) / kIdxFiles[i];
    TORCH_CHECK(fs::exists(path), "ddpx-train: missing data file ", path.string(),
                " (an MNIST idx directory holds ", kIdxFiles[0], ", ", kIdxFiles[1], ", ",
                kIdxFiles[2], ", ", kIdxFiles[3], ")");
    const bool images = i % 2 == 0;
    const uint32_t want_count = i < 2 ? kTrainCount : kTestCount;
    const uint64_t header = images ? 16 : 8, item = images ? kPixels : 1;
    const uint64_t size = fs::file_size(path);
    std::ifstream f(path, std::ios::binary);
    const uint32_t magic = get_be32(f), count = get_be32(f);
    TORCH_CHECK(f.good() && magic == (images ? kImageMagic : kLabelMagic),
                "ddpx-train: corrupt idx file ", path.string(), ": magic number ", magic,
                ", expected ", images ? kImageMagic : kLabelMagic);
    TORCH_CHECK(count == want_count, "ddpx-train: idx file ", path.string(), " holds ", count,
                " items; LibTorch's MNIST reader needs ", want_count);
    if (images) {
      const uint32_t rows = get_be32(f), cols = get_be32(f);
      TORCH_CHECK(rows == kSide && cols == kSide, "ddpx-train: corrupt idx file ", path.string(),
                  ": images are ", rows, "x", cols, ", expected 28x28");
    }
    TORCH_CHECK(size == header + uint64_t(count) * item, "ddpx-train: corrupt idx file ",
                path.string(), ": ", size, " bytes, its header promises ",
                header + uint64_t(count) * item, " (truncated?)");
    if (!images) {
      std::vector<uint8_t> labels(count);
      f.read(reinterpret_cast<char*>(labels.data()), count);
      const auto bad = std::find_if(labels.begin(), labels.end(), [](uint8_t l) { return l >= 10; });
      TORCH_CHECK(bad == labels.end(), "ddpx-train: corrupt idx file ", path.string(), ": label ",
                  int(*bad), " at item ", bad - labels.begin(), " is not a class 0..9");
    }
  }
}

DataSplit load_images(const std::string& dir) {
  check_idx_files(dir);
  using torch::data::datasets::MNIST;
  DataSplit out;
  out.num_classes = kClasses;
  const std::pair<MNIST::Mode, Dataset*> parts[] = {{MNIST::Mode::kTrain, &out.train},
                                                    {MNIST::Mode::kTest, &out.test}};
  for (const auto& [mode, ds] : parts) {
    MNIST mnist(dir, mode);
    // MNIST's own mean and deviation, as every MNIST example normalises.
    ds->inputs = mnist.images().sub(0.1307).div_(0.3081);
    ds->targets = mnist.targets();
  }
  return out;
}

at::Tensor shard_indices(int64_t n, int rank, int world, int64_t epoch, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ULL + uint64_t(epoch));
  const at::Tensor perm = at::randperm(n, gen, at::kLong);
  const int64_t per_rank = n / world;
  return perm.narrow(0, 0, per_rank * world).view({per_rank, world}).select(1, rank).contiguous();
}

}  // namespace ddpx::trainer
