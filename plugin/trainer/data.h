#pragma once
// ddpx-train's data: whole datasets held in memory as tensors, and each
// rank's shard of an epoch.
//
// Images come from MNIST idx files read by LibTorch's MNIST dataset, so real
// MNIST drops in with --data DIR; without it a deterministic, learnable
// 10-class set is generated into idx files first. Documents for token models
// (HAN) are generated in memory: each sentence has a dominant topic, and a
// document's label is the topic most sentences have, counted per sentence
// (sentences of other topics carry more topic words, so counting words over
// the whole document points the wrong way).
#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace ddpx::trainer {

struct Dataset {
  at::Tensor inputs;   // images: [N, 1, 28, 28] float (normalised); tokens: [N, S, W] int64
  at::Tensor targets;  // [N] int64
  int64_t size() const { return targets.size(0); }
};

struct DataSplit {
  Dataset train, test;
  int64_t num_classes = 0;
};

// The four MNIST idx files.
inline constexpr const char* kIdxFiles[] = {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                            "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"};

// Writes the generated image set (60000 train, 10000 test: the sizes LibTorch's
// MNIST reader requires) into `dir` unless valid files are already there.
// Each file is written to a temporary name and renamed, so ranks sharing a
// directory never see a partial file.
void ensure_synthetic_images(const std::string& dir, uint64_t seed);

// Checks the idx files in `dir`: present, right magic numbers and counts,
// sizes that match their headers, labels in 0..9. Throws naming the file.
void check_idx_files(const std::string& dir);

// Loads and normalises an idx directory (after check_idx_files).
DataSplit load_images(const std::string& dir);

struct DocSpec {
  int64_t vocab = 2000, sentences = 8, words = 12, classes = 4;
};
DataSplit make_documents(const DocSpec& spec, int64_t n_train, int64_t n_test, uint64_t seed);

// The sample indices `rank` visits in `epoch`: a permutation of [0, n) drawn
// from (seed, epoch), dealt round-robin to the ranks; the remainder is dropped
// so every rank takes the same number of steps. [n / world] int64
at::Tensor shard_indices(int64_t n, int rank, int world, int64_t epoch, uint64_t seed);

}  // namespace ddpx::trainer
