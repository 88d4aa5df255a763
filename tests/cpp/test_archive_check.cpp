// ddpx::detail::check_torch_archive / check_pickle: real archives (LibTorch's
// pickle_save and OutputArchive, Python's torch.save) pass and every tensor in
// them is understood; damaged lengths, memo indices, storages and tensor
// extents are refused with an error naming the record, before torch's reader
// reserves or reads anything they declare.
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/serialize.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>

#include "plugin/archive_check.h"

namespace {

using ddpx::detail::check_pickle;
using ddpx::detail::check_torch_archive;
using ddpx::detail::open_torch_archive;

std::string u32(uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[i] = char((v >> (8 * i)) & 0xFF);
  return s;
}
std::string str(const std::string& s) { return "X" + u32(uint32_t(s.size())) + s; }
std::string ints(const std::vector<int32_t>& v) {
  std::string s = "(";
  for (int32_t x : v) s += "J" + u32(uint32_t(x));
  return s + "t";
}

// A tensor as torch's pickler writes one: _rebuild_tensor_v2(storage
// ("storage", torch.FloatStorage, "0", "cpu", numel), offset, sizes, strides,
// requires_grad, hooks).
std::string tensor_pickle(int32_t numel, int32_t offset, const std::vector<int32_t>& sizes,
                          const std::vector<int32_t>& strides) {
  return std::string("\x80\x02") + "ctorch._utils\n_rebuild_tensor_v2\n" + "((" + str("storage") +
         "ctorch\nFloatStorage\n" + str("0") + str("cpu") + "J" + u32(uint32_t(numel)) + "tQ" +
         "J" + u32(uint32_t(offset)) + ints(sizes) + ints(strides) + "\x89}tR.";
}

// A zip archive as torch writes one, of the given records.
std::string zip(const std::vector<std::pair<std::string, std::string>>& records) {
  std::string out;
  caffe2::serialize::PyTorchStreamWriter w([&](const void* p, size_t n) {
    out.append(static_cast<const char*>(p), n);
    return n;
  });
  for (const auto& [name, bytes] : records) w.writeRecord(name, bytes.data(), bytes.size());
  w.writeEndOfFile();
  return out;
}

std::string float_bytes(int n) {
  std::string s(4 * n, '\0');
  for (int i = 0; i < n; ++i) {
    const float f = float(i);
    std::memcpy(&s[4 * i], &f, 4);
  }
  return s;
}

c10::IValue load(const std::string& bytes) {
  const auto reader = open_torch_archive(bytes.data(), bytes.size(), "test");
  return torch::jit::readArchiveAndTensors("data", "", "", std::nullopt, std::nullopt,
                                           std::nullopt, *reader);
}

ddpx::detail::PickleChecked walk(const std::string& pickle, int64_t record_bytes = 1 << 20) {
  return check_pickle(pickle.data(), pickle.size(), "data.pkl",
                      [&](const std::string& key) { return key == "0" ? record_bytes : -1; });
}

template <class F>
void expect_refused(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "accepted; expected an error containing '" << needle << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(ArchiveCheck, HandWrittenTensorIsTheOneTorchReads) {
  // The fixture format is torch's: LibTorch loads it, and the walk sees it.
  const std::string pickle = tensor_pickle(6, 1, {2, 2}, {1, 2});
  const at::Tensor t = load(zip({{"data.pkl", pickle}, {"data/0", float_bytes(6)}})).toTensor();
  EXPECT_TRUE(t.equal(at::arange(6, at::kFloat).as_strided({2, 2}, {1, 2}, 1)));
  const auto seen = walk(pickle, 24);
  EXPECT_EQ(seen.storages, 1u);
  EXPECT_EQ(seen.tensors, 1u);
}

TEST(ArchiveCheck, LibTorchArchivesPassAndEveryTensorIsSeen) {
  const at::Tensor base = at::arange(24, at::kFloat).view({2, 3, 4});
  c10::Dict<std::string, at::Tensor> d;
  d.insert("base", base);
  d.insert("view", base.slice(0, 1).slice(2, 1, 3));
  d.insert("t", at::randn({3, 5}).t());
  d.insert("empty", at::zeros({0, 4}));
  d.insert("bool", at::tensor({1, 0}).to(at::kBool));
  d.insert("half", at::ones({3}, at::kHalf));
  d.insert("complex", at::ones({2}, at::kComplexDouble));
  d.insert("int8", at::arange(-3, 3, at::kChar));
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(d));
  const std::string s(bytes.begin(), bytes.end());
  const auto loaded = load(s).toGenericDict();
  for (const auto& kv : d) EXPECT_TRUE(loaded.at(kv.key()).toTensor().equal(kv.value()));

  auto reader = open_torch_archive(s.data(), s.size(), "test");
  auto [pkl, n] = reader->getRecord("data.pkl");
  const auto seen = check_pickle(static_cast<const char*>(pkl.get()), n, "data.pkl",
                                 [&](const std::string& k) {
                                   return int64_t(reader->getRecordSize("data/" + k));
                                 });
  EXPECT_EQ(seen.tensors, d.size());
  EXPECT_GE(seen.storages, d.size() - 1);  // view shares base's

  // A checkpoint-like OutputArchive (a TorchScript module archive).
  torch::serialize::OutputArchive ar, inner;
  ar.write("w", base);
  ar.write("n", c10::IValue(int64_t(7)));
  inner.write("m", at::ones({4, 4}).t());
  ar.write("optimizer", inner);
  std::string ckpt;
  ar.save_to([&](const void* p, size_t k) {
    ckpt.append(static_cast<const char*>(p), k);
    return k;
  });
  EXPECT_NO_THROW(check_torch_archive(ckpt.data(), ckpt.size(), "checkpoint"));
  // ...whose source ranges are walked too (and pass).
  const auto records = open_torch_archive(ckpt.data(), ckpt.size(), "ckpt")->getAllRecords();
  EXPECT_TRUE(std::any_of(records.begin(), records.end(), [](const std::string& r) {
    return r.size() > 10 && r.compare(r.size() - 10, 10, ".debug_pkl") == 0;
  }));
}

TEST(ArchiveCheck, PythonTorchSaveIsUnderstood) {
  const char* path = std::getenv("DDPX_TORCH_SAVE_FILE");
  if (!path) GTEST_SKIP() << "DDPX_TORCH_SAVE_FILE unset (ctest sets it)";
  std::ifstream f(path, std::ios::binary);
  ASSERT_TRUE(f) << path;
  const std::string s{std::istreambuf_iterator<char>(f), {}};
  auto reader = open_torch_archive(s.data(), s.size(), path);
  auto [pkl, n] = reader->getRecord("data.pkl");
  const auto seen = check_pickle(static_cast<const char*>(pkl.get()), n, "data.pkl",
                                 [&](const std::string& k) {
                                   return int64_t(reader->getRecordSize("data/" + k));
                                 });
  EXPECT_EQ(seen.tensors, 8u);   // every tensor of export_torch_save.py
  EXPECT_EQ(seen.storages, 8u);  // one persistent id per tensor, the shared one twice
  const auto d = load(s).toGenericDict();
  const at::Tensor x = at::arange(24, at::kByte).view({2, 3, 4});
  EXPECT_TRUE(d.at("train_x").toTensor().equal(x));
  EXPECT_TRUE(d.at("view").toTensor().equal(x.slice(0, 1).slice(2, 1, 3)));
  EXPECT_EQ(d.at("big").toTensor().item<int64_t>(), int64_t(1) << 40);
  EXPECT_EQ(d.at("empty").toTensor().sizes(), c10::IntArrayRef({0, 4}));
}

TEST(ArchiveCheck, StoragesAndTensorsOutsideTheirBytesAreRefused) {
  // The record holds 5 floats, the storage declares 6.
  expect_refused([] { walk(tensor_pickle(6, 0, {6}, {1}), 20); },
                 "storage '0' declares 24 bytes (6 x torch.FloatStorage) but its record holds 20");
  expect_refused([] { walk(tensor_pickle(6, 0, {6}, {1}), -1); }, "its record is missing");
  // Sizes, strides or offset that reach past the storage's 6 elements.
  expect_refused([] { walk(tensor_pickle(6, 0, {7}, {1})); }, "a tensor reaches byte 28 of a storage of 24");
  expect_refused([] { walk(tensor_pickle(6, 3, {2, 2}, {2, 1})); }, "reaches byte 28");
  expect_refused([] { walk(tensor_pickle(6, 0, {2, 1 << 30}, {1, 1 << 30})); }, "reaches byte");
  expect_refused([] { walk(tensor_pickle(6, 0, {2}, {-1})); }, "is not a non-negative integer");
  expect_refused([] { walk(tensor_pickle(6, 0, {2, 2}, {1})); }, "2 sizes and 1 strides");
  expect_refused([] { walk(tensor_pickle(6, -1, {2}, {1})); }, "storage offset is -1");
  expect_refused([] { walk(tensor_pickle(-2, 0, {2}, {1})); }, "of -2 elements");
  // At the edge: exactly the storage, and an empty tensor anywhere.
  EXPECT_EQ(walk(tensor_pickle(6, 2, {2, 2}, {2, 1}), 24).tensors, 1u);
  EXPECT_EQ(walk(tensor_pickle(0, 0, {0, 5}, {5, 1}), 0).tensors, 1u);
}

TEST(ArchiveCheck, LengthsAndMemoIndicesBeyondTheRecordAreRefused) {
  const std::string proto("\x80\x02", 2);
  // LONG_BINPUT 0xFFFFFFF0: torch would grow its memo table to 4G entries.
  expect_refused([&] { walk(proto + "}r" + u32(0xFFFFFFF0u) + "."); }, "memo index 4294967280");
  // A 4 GB string in a 20-byte record.
  expect_refused([&] { walk(proto + "X" + u32(0xFFFFFFFFu) + "abc."); },
                 "a string of 4294967295 bytes, with 4 left");
  expect_refused([&] { walk(proto + "J" + "\x01\x02"); }, "runs past its end");
  expect_refused([&] { walk(proto + "ctorch\nFloat"); }, "a name runs past its end");
  expect_refused([&] { walk(proto + "\x85."); }, "it needs 1 values on its stack, has 0");
  expect_refused([&] { walk(proto + "t."); }, "no MARK to close");
  expect_refused([&] { walk(proto + "\xff."); }, "opcode 255 is not one torch's unpickler reads");
  expect_refused([&] { walk("N."); }, "does not start with PROTO");
  expect_refused([&] { walk(proto + "N"); }, "runs past its end");  // no STOP
  // Memo indices in range, and gets of what was never put (torch: None).
  EXPECT_NO_THROW(walk(proto + "}q\x05h\x05h\x09" + "00."));
}

// A pickle of one string whose length field says `len` (3 bytes follow).
std::string str_pickle_of_length(uint32_t len) {
  return std::string("\x80\x02X", 3) + u32(len) + "abc.";
}

TEST(ArchiveCheck, DamagedArchivesFailBeforeTorchReadsThem) {
  const std::string huge_memo = std::string("\x80\x02}r", 4) + u32(0xFFFFFFF0u) + ".";
  const std::string a = zip({{"data.pkl", huge_memo}});
  expect_refused([&] { check_torch_archive(a.data(), a.size(), "bad.pt"); },
                 "bad.pt: record data.pkl is damaged at byte 3 of 9: memo index");
  const std::string b = zip({{"data.pkl", tensor_pickle(6, 0, {6}, {1})}, {"data/0", float_bytes(5)}});
  expect_refused([&] { check_torch_archive(b.data(), b.size(), "bad.pt"); },
                 "declares 24 bytes");
  // Constants of a TorchScript archive are bounded by their own directory.
  const std::string c = zip({{"constants.pkl", tensor_pickle(6, 0, {6}, {1})},
                             {"constants/0", float_bytes(5)}, {"data/0", float_bytes(6)}});
  expect_refused([&] { check_torch_archive(c.data(), c.size(), "bad.pt"); },
                 "record constants.pkl is damaged");
  // A TorchScript file's source ranges, read only to report an error in its
  // code (found by fuzz_checkpoint: 1.1 GB reserved for a 106-byte record).
  const std::string d =
      zip({{"code/__torch__.py.debug_pkl", str_pickle_of_length(0x45FFFFFFu)}});
  expect_refused([&] { check_torch_archive(d.data(), d.size(), "bad.pt"); },
                 "record code/__torch__.py.debug_pkl is damaged at byte 7 of 11: a string of "
                 "1174405119 bytes");
  const std::string legacy = "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.";
  expect_refused([&] { check_torch_archive(legacy.data(), legacy.size(), "old.pt"); },
                 "old.pt is not a zip archive");
}

}  // namespace
