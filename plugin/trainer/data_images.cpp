// The generated image set, written as MNIST idx files (read back by
// data_files.cpp like any other idx directory).
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <ddpx/data.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "plugin/trainer/data.h"

namespace ddpx::trainer {
namespace {

namespace fs = std::filesystem;
constexpr int kSide = 28, kPixels = kSide * kSide, kClasses = 10;
constexpr uint32_t kImageMagic = 2051, kLabelMagic = 2049;
constexpr uint32_t kTrainCount = 60000, kTestCount = 10000;  // MNIST's counts

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

void generate_split(std::mt19937_64& rng, const std::array<Image, kClasses>& protos, uint32_t count,
                    std::vector<uint8_t>& pixels, std::vector<uint8_t>& labels) {
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

// The generator's files, complete (they are renamed into place whole). A
// damaged file of the right size is reported when it is read.
bool generated_files_present(const std::string& dir) {
  const uint64_t sizes[4] = {16 + uint64_t(kTrainCount) * kPixels, 8 + uint64_t(kTrainCount),
                             16 + uint64_t(kTestCount) * kPixels, 8 + uint64_t(kTestCount)};
  for (int i = 0; i < 4; ++i) {
    std::error_code ec;
    if (fs::file_size(fs::path(dir) / kIdxFiles[i], ec) != sizes[i] || ec) return false;
  }
  return true;
}

}  // namespace

void ensure_synthetic_images(const std::string& dir, uint64_t seed) {
  if (generated_files_present(dir)) return;
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

at::Tensor shard_indices(int64_t n, int rank, int world, int64_t epoch, uint64_t seed) {
  const at::Tensor perm = ddpx::data::epoch_permutation(n, epoch, seed);
  const int64_t per_rank = n / world;
  return perm.narrow(0, 0, per_rank * world).view({per_rank, world}).select(1, rank).contiguous();
}

}  // namespace ddpx::trainer
