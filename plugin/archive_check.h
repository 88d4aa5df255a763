#pragma once
// Bounds for torch's zip archives read from files a user hands us (ddpx-train
// --data, --resume checkpoints, parameter-server checkpoints).
//
// torch's readers trust every length and size the file declares: the zip
// directory's record sizes, the pickle's memo indices and string lengths, a
// storage's element count and a tensor's sizes and strides. A damaged or
// hostile file makes them reserve gigabytes (LONG_BINPUT 0xFFFFFFFF grows the
// memo table to 4G entries) or build a tensor larger than the bytes behind it
// (read past the end of the heap block). check_torch_archive walks the
// archive before torch does and refuses, with a c10::Error naming the record
// and the offset, anything a torch writer cannot have produced.
#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace caffe2::serialize {
class PyTorchStreamReader;
}

namespace ddpx::detail {

// Opens the zip archive `data` (which must outlive the reader) through a
// reader that answers reads past its end short, and checks it as below.
std::unique_ptr<caffe2::serialize::PyTorchStreamReader> open_torch_archive(
    const char* data, size_t size, const std::string& what);

// Checks the zip archive `data` (torch.save, torch::save, torch::pickle_save,
// torch::jit::save): every record fits inside the file, and every pickle
// record ("<name>.pkl", and TorchScript's source ranges "<file>.debug_pkl")
// walks within its bytes, with memo indices below its length, and every
// storage it names ("<name>/<key>") at least as large as
// the elements it declares, and every tensor it rebuilds inside its storage.
// `what` names the file in errors.
void check_torch_archive(const char* data, size_t size, const std::string& what);

// The pickle walk alone: `pickle` is record `record`'s bytes; `storage_bytes`
// answers the size of record "<dir>/<key>" (or -1 when there is none).
// Returns what it checked (tests use it to see that real files are understood).
struct PickleChecked {
  size_t storages = 0;  // persistent ids bounded by their record
  size_t tensors = 0;   // tensors bounded by their storage
};
PickleChecked check_pickle(const char* pickle, size_t size, const std::string& record,
                  const std::function<int64_t(const std::string& key)>& storage_bytes);

}  // namespace ddpx::detail
