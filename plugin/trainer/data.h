#pragma once
// ddpx-train's data: whole datasets held in memory as tensors, and each
// rank's shard of an epoch.
//
// --data names either an idx directory (MNIST's format, of any count and
// image size: the files carry their own; EMNIST, a subset of MNIST, ...) or
// a file written by torch.save of a dict {train_x, train_y, test_x, test_y}
// (images or tokens). Either is checked against what the model takes (its
// InputSpec), so a mismatch is an error naming both, not a crash in forward.
// Without --data, images are generated into idx files first (a deterministic,
// learnable 10-class set), and documents for token models (HAN) in memory:
// each sentence has a dominant topic, and a document's label is the topic
// most sentences have, counted per sentence (sentences of other topics carry
// more topic words, so counting words over the whole document points the
// wrong way).
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ddpx::trainer {

struct Dataset {
  at::Tensor inputs;   // images: [N, 1, 28, 28] float (normalised); tokens: [N, S, W] int64
  at::Tensor targets;  // [N] int64
  int64_t size() const { return targets.size(0); }
};

struct DocSpec {
  int64_t vocab = 2000, sentences = 8, words = 12, classes = 4;
};

// What a model takes (the contract of scripts/export_models.py).
struct InputSpec {
  std::string kind;                             // "image" or "tokens"
  std::vector<int64_t> image_shape{1, 28, 28};  // images: one sample, [C, H, W]
  DocSpec doc;                                  // tokens: vocab, sentences, words
  int64_t num_classes = 0;
  std::string model;  // its file, for messages
};

struct DataSplit {
  Dataset train, test;
  int64_t num_classes = 0;
};

// The four MNIST idx files.
inline constexpr const char* kIdxFiles[] = {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                            "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"};

// Writes the generated image set (60000 train, 10000 test of 1x28x28, 10
// classes) into `dir` unless files of its sizes are already there. Each file
// is written to a temporary name and renamed, so ranks sharing a directory
// never see a partial file.
void ensure_synthetic_images(const std::string& dir, uint64_t seed);

// Reads one idx file (any element type and rank; big-endian on disk) into a
// tensor of its type and shape. Throws naming the file on a bad header, an
// unknown type or a size that disagrees with the header.
at::Tensor read_idx(const std::string& path);

// The parsers behind read_idx and load_data_path's torch.save files, on bytes
// in memory (`name` is the file, for messages); tests/fuzz drives them.
at::Tensor parse_idx(const char* data, size_t size, const std::string& name);
DataSplit parse_saved_dict(const char* data, size_t size, const std::string& name,
                           const InputSpec& spec);

// Loads `path` (an idx directory or a torch.save file) for `spec`: checks
// shapes, dtypes, counts, labels (0..num_classes-1) and token ids (0..vocab-1)
// and throws naming the file and both shapes on a mismatch. Integer images
// are scaled to [0, 1] and standardised with the training set's mean and
// deviation (on MNIST: 0.1307 and 0.3081); floating-point images are taken
// as they are.
DataSplit load_data_path(const std::string& path, const InputSpec& spec);

DataSplit make_documents(const DocSpec& spec, int64_t n_train, int64_t n_test, uint64_t seed);

// The sample indices `rank` visits in `epoch`: a permutation of [0, n) drawn
// from (seed, epoch), dealt round-robin to the ranks; the remainder is dropped
// so every rank takes the same number of steps. [n / world] int64
// Dealt round-robin, step k of b samples per rank trains on the permutation's
// elements [k * B, (k + 1) * B), B = b * world, whatever the world size: with
// the same B (--global-batch) 1, 2 or 3 ranks see the same global batches in
// the same order, and the same epochs (n / world / b = n / B steps).
at::Tensor shard_indices(int64_t n, int rank, int world, int64_t epoch, uint64_t seed);

}  // namespace ddpx::trainer
