// The walk behind check_torch_archive (archive_check.h): the zip directory,
// then each pickle record with a stack machine that keeps only what a bound
// needs -- integers, strings, globals, tuples and storages -- and treats every
// other value as opaque. It follows torch's Unpickler's stack discipline
// (NEWOBJ pops one, BUILD and REDUCE pop two and push one), so a file torch
// reads walks here the same way.
#include "plugin/archive_check.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <unordered_map>
#include <vector>

namespace ddpx::detail {
namespace {

// Answers reads past the end short (the zip reader then reports a damaged
// file) instead of copying whatever range a damaged directory names.
class BoundedReader final : public caffe2::serialize::ReadAdapterInterface {
 public:
  BoundedReader(const char* data, size_t size) : data_(data), size_(size) {}
  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= size_ || n == 0) return 0;
    n = static_cast<size_t>(std::min<uint64_t>(n, size_ - pos));
    std::memcpy(buf, data_ + pos, n);
    return n;
  }

 private:
  const char* data_;
  size_t size_;
};

// The element size of torch's storage class `name` ("FloatStorage"), 0 if
// it is none.
size_t storage_item_size(const std::string& name) {
#define DDPX_STORAGE_SIZE(_, n) \
  if (name == #n "Storage") return c10::elementSize(c10::ScalarType::n);
  AT_FORALL_SCALAR_TYPES_WITH_COMPLEX_AND_QINTS(DDPX_STORAGE_SIZE)
#undef DDPX_STORAGE_SIZE
  return 0;
}

struct Item {
  enum Kind { kOpaque, kInt, kStr, kGlobal, kTuple, kStorage } kind = kOpaque;
  int64_t i = 0;            // kInt: the value; kStorage: its bytes
  size_t item_size = 0;     // kStorage
  std::string s;            // kStr, kGlobal ("module.name")
  std::shared_ptr<const std::vector<Item>> elems;  // kTuple

  static Item of(Kind k, int64_t i, std::string s = {}) {
    Item it;
    it.kind = k;
    it.i = i;
    it.s = std::move(s);
    return it;
  }
};

class PickleWalk {
 public:
  PickleWalk(const char* p, size_t n, const std::string& record,
             const std::function<int64_t(const std::string&)>& storage_bytes)
      : p_(p), n_(n), record_(record), storage_bytes_(storage_bytes) {}

  PickleChecked run() {
    TORCH_CHECK(n_ >= 2 && uint8_t(p_[0]) == 0x80, bad(0), "it does not start with PROTO");
    pos_ = 2;
    while (step()) {
    }
    return checked_;
  }

 private:
  std::string bad(size_t at) const {
    return "record " + record_ + " is damaged at byte " + std::to_string(at) + " of " +
           std::to_string(n_) + ": ";
  }
  const char* take(size_t k) {
    TORCH_CHECK(k <= n_ - pos_, bad(pos_), "an argument of ", k, " bytes runs past its end");
    const char* at = p_ + pos_;
    pos_ += k;
    return at;
  }
  uint64_t uint_le(size_t k) {
    const auto* b = reinterpret_cast<const unsigned char*>(take(k));
    uint64_t v = 0;
    for (size_t j = k; j-- > 0;) v = (v << 8) | b[j];
    return v;
  }
  std::string line() {
    const void* nl = std::memchr(p_ + pos_, '\n', n_ - pos_);
    TORCH_CHECK(nl, bad(pos_), "a name runs past its end");
    const size_t len = static_cast<const char*>(nl) - (p_ + pos_);
    std::string s(take(len), len);
    ++pos_;
    return s;
  }
  // A length field: what follows must be in the record.
  std::string bytes(size_t len_size) {
    const uint64_t len = uint_le(len_size);
    TORCH_CHECK(len <= n_ - pos_, bad(pos_), "a string of ", len, " bytes, with ", n_ - pos_,
                " left");
    return std::string(take(len), len);
  }
  Item pop() {
    TORCH_CHECK(!stack_.empty(), bad(op_at_), "its stack is empty");
    Item it = std::move(stack_.back());
    stack_.pop_back();
    return it;
  }
  std::vector<Item> pop_mark() {
    TORCH_CHECK(!marks_.empty() && marks_.back() <= stack_.size(), bad(op_at_),
                "no MARK to close");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Item> v(std::make_move_iterator(stack_.begin() + m),
                        std::make_move_iterator(stack_.end()));
    stack_.resize(m);
    return v;
  }
  void need(size_t k) {
    TORCH_CHECK(stack_.size() >= k, bad(op_at_), "it needs ", k, " values on its stack, has ",
                stack_.size());
  }
  void push_int(int64_t v) { stack_.push_back(Item::of(Item::kInt, v)); }
  void push_tuple(std::vector<Item> v) {
    Item t = Item::of(Item::kTuple, 0);
    t.elems = std::make_shared<const std::vector<Item>>(std::move(v));
    stack_.push_back(std::move(t));
  }
  void put(uint64_t id) {
    // A pickler numbers its memo entries 0, 1, 2...; each costs two bytes at
    // least, so no real file has an index as large as itself.
    TORCH_CHECK(id < n_, bad(op_at_), "memo index ", id, " in a pickle of ", n_, " bytes");
    need(1);
    memo_[id] = stack_.back();
  }
  void get(uint64_t id) {
    auto it = memo_.find(id);
    stack_.push_back(it == memo_.end() ? Item{} : it->second);
  }

  // ("storage", <torch.XStorage>, key, location, numel): the record must hold numel elements.
  void persistent_id() {
    const Item t = pop();
    Item out;
    if (t.kind == Item::kTuple && t.elems->size() >= 5) {
      const auto& e = *t.elems;
      const size_t item = e[1].kind == Item::kGlobal && e[1].s.rfind("torch.", 0) == 0
                              ? storage_item_size(e[1].s.substr(6))
                              : 0;
      if (e[0].kind == Item::kStr && e[0].s == "storage" && e[2].kind == Item::kStr && item &&
          e[4].kind == Item::kInt) {
        const int64_t numel = e[4].i;
        TORCH_CHECK(numel >= 0 && uint64_t(numel) <= uint64_t(INT64_MAX) / item, bad(op_at_),
                    "storage '", e[2].s, "' of ", numel, " elements");
        const int64_t want = numel * int64_t(item);
        if (want > 0) {
          const int64_t have = storage_bytes_(e[2].s);
          TORCH_CHECK(have >= want, bad(op_at_), "storage '", e[2].s, "' declares ", want,
                      " bytes (", numel, " x ", e[1].s, ") but its record ",
                      have < 0 ? std::string("is missing") : "holds " + std::to_string(have));
        }
        ++checked_.storages;
        out.kind = Item::kStorage;
        out.i = want;
        out.item_size = item;
      }
    }
    stack_.push_back(std::move(out));
  }

  // _rebuild_tensor_v2(storage, offset, sizes, strides, ...): inside the storage.
  void check_tensor(const Item& args) {
    if (args.kind != Item::kTuple || args.elems->size() < 4) return;
    const auto& e = *args.elems;
    if (e[0].kind != Item::kStorage || e[1].kind != Item::kInt || e[2].kind != Item::kTuple ||
        e[3].kind != Item::kTuple)
      return;
    const auto& sizes = *e[2].elems;
    const auto& strides = *e[3].elems;
    TORCH_CHECK(sizes.size() == strides.size(), bad(op_at_), "a tensor of ", sizes.size(),
                " sizes and ", strides.size(), " strides");
    __int128 last = e[1].i;  // the offset of its last element (no overflow: < 2^64 x 2^64 terms)
    bool empty = false;
    for (size_t d = 0; d < sizes.size(); ++d) {
      TORCH_CHECK(sizes[d].kind == Item::kInt && strides[d].kind == Item::kInt &&
                      sizes[d].i >= 0 && strides[d].i >= 0,
                  bad(op_at_), "a tensor's size or stride in dimension ", d,
                  " is not a non-negative integer");
      empty = empty || sizes[d].i == 0;
      if (sizes[d].i > 0) last += __int128(sizes[d].i - 1) * strides[d].i;
    }
    TORCH_CHECK(e[1].i >= 0, bad(op_at_), "a tensor's storage offset is ", e[1].i);
    ++checked_.tensors;
    if (empty) return;
    const __int128 need_bytes = (last + 1) * __int128(e[0].item_size);
    TORCH_CHECK(need_bytes <= e[0].i, bad(op_at_), "a tensor reaches byte ",
                static_cast<int64_t>(std::min<__int128>(need_bytes, INT64_MAX)),
                " of a storage of ", e[0].i);
  }

  void reduce() {
    need(2);
    const Item args = pop();
    const Item fn = pop();
    if (fn.kind == Item::kGlobal) {
      if (fn.s == "torch._utils._rebuild_tensor_v2" || fn.s == "torch._utils._rebuild_qtensor") {
        check_tensor(args);
      } else if (fn.s == "torch._tensor._rebuild_from_type_v2" && args.kind == Item::kTuple &&
                 args.elems->size() >= 3) {
        check_tensor((*args.elems)[2]);  // (func, type, args of func, state)
      }
    }
    stack_.emplace_back();
  }

  // One opcode; false after STOP.
  bool step() {
    op_at_ = pos_;
    const uint8_t op = static_cast<uint8_t>(*take(1));
    switch (op) {
      case '.': return false;                                     // STOP
      case '(': marks_.push_back(stack_.size()); break;           // MARK
      case ']': case '}': case 'N': case 0x88: case 0x89:         // empty list/dict, None, bools
        stack_.emplace_back();
        break;
      case 'G': take(8); stack_.emplace_back(); break;           // BINFLOAT
      case ')': push_tuple({}); break;                            // EMPTY_TUPLE
      case 'K': push_int(int64_t(uint_le(1))); break;             // BININT1
      case 'M': push_int(int64_t(uint_le(2))); break;             // BININT2
      case 'J': push_int(int32_t(uint32_t(uint_le(4)))); break;   // BININT
      case 0x8a: case 0x8b: {                                     // LONG1, LONG4
        const std::string b = bytes(op == 0x8a ? 1 : 4);
        int64_t v = 0;
        if (!b.empty() && b.size() <= 8) {
          uint64_t u = 0;
          for (size_t j = b.size(); j-- > 0;) u = (u << 8) | uint8_t(b[j]);
          if (b.size() < 8 && (uint8_t(b.back()) & 0x80)) u |= ~uint64_t(0) << (8 * b.size());
          v = int64_t(u);
        }
        push_int(v);
        break;
      }
      case 'X': case 'B': stack_.push_back(Item::of(Item::kStr, 0, bytes(4))); break;
      case 0x8c: case 'C': stack_.push_back(Item::of(Item::kStr, 0, bytes(1))); break;
      case 0x8d: case 0x8e: stack_.push_back(Item::of(Item::kStr, 0, bytes(8))); break;
      case 0x95: take(8); break;                                  // FRAME
      case 'c': {                                                 // GLOBAL
        std::string module = line();
        std::string name = line();
        stack_.push_back(Item::of(Item::kGlobal, 0, module + "." + name));
        break;
      }
      case 't': push_tuple(pop_mark()); break;                    // TUPLE
      case 0x85: case 0x86: case 0x87: {                          // TUPLE1..3
        const size_t k = op - 0x84;
        need(k);
        std::vector<Item> v(std::make_move_iterator(stack_.end() - k),
                            std::make_move_iterator(stack_.end()));
        stack_.resize(stack_.size() - k);
        push_tuple(std::move(v));
        break;
      }
      case 'l': case 'd': pop_mark(); stack_.emplace_back(); break;  // LIST, DICT
      case 'e': case 'u': pop_mark(); need(1); break;             // APPENDS, SETITEMS
      case '1': pop_mark(); break;                                // POP_MARK
      case 's': need(3); pop(); pop(); break;                     // SETITEM
      case 'a': case '0': case 0x81: need(1); pop(); break;       // APPEND, POP, NEWOBJ
      case '2': need(1); stack_.push_back(stack_.back()); break;  // DUP
      case 'q': put(uint_le(1)); break;                           // BINPUT
      case 'r': put(uint_le(4)); break;                           // LONG_BINPUT
      case 0x94: put(memo_.size()); break;                        // MEMOIZE
      case 'h': get(uint_le(1)); break;                           // BINGET
      case 'j': get(uint_le(4)); break;                           // LONG_BINGET
      case 'Q': persistent_id(); break;                           // BINPERSID
      case 'R': case 'b': reduce(); break;                        // REDUCE, BUILD
      default:
        TORCH_CHECK(false, bad(op_at_), "opcode ", int(op), " is not one torch's unpickler reads");
    }
    return true;
  }

  const char* p_;
  size_t n_;
  const std::string& record_;
  const std::function<int64_t(const std::string&)>& storage_bytes_;
  size_t pos_ = 0, op_at_ = 0;
  std::vector<Item> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Item> memo_;
  PickleChecked checked_;
};

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

void check_records(caffe2::serialize::PyTorchStreamReader& reader, size_t file_size,
                   const std::string& what) {
  std::unordered_map<std::string, size_t> sizes;
  for (const std::string& name : reader.getAllRecords()) {
    const size_t n = reader.getRecordSize(name);
    // torch writes records stored, not compressed: each is inside the file.
    TORCH_CHECK(n <= file_size, what, ": its record ", name, " declares ", n,
                " bytes, more than the file's ", file_size, " (damaged?)");
    sizes[name] = n;
  }
  for (const auto& [name, n] : sizes) {
    // A TorchScript archive's "code/<file>.py.debug_pkl" (source ranges) is a
    // pickle too, unpickled only when torch reports an error in that code --
    // after this check -- so it is walked like the others; it names no
    // storages.
    const bool debug = ends_with(name, ".debug_pkl");
    if (!debug && !ends_with(name, ".pkl")) continue;
    const std::string dir = name.substr(0, name.size() - 4) + "/";
    const std::function<int64_t(const std::string&)> storage = [&](const std::string& key) {
      auto it = debug ? sizes.end() : sizes.find(dir + key);
      return it == sizes.end() ? int64_t(-1) : int64_t(it->second);
    };
    auto [ptr, len] = reader.getRecord(name);
    try {
      check_pickle(static_cast<const char*>(ptr.get()), len, name, storage);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, what, ": ", e.what_without_backtrace());
    }
  }
}

}  // namespace

PickleChecked check_pickle(const char* pickle, size_t size, const std::string& record,
                           const std::function<int64_t(const std::string& key)>& storage_bytes) {
  return PickleWalk(pickle, size, record, storage_bytes).run();
}

std::unique_ptr<caffe2::serialize::PyTorchStreamReader> open_torch_archive(
    const char* data, size_t size, const std::string& what) {
  TORCH_CHECK(size >= 4 && std::memcmp(data, "PK\x03\x04", 4) == 0, what,
              " is not a zip archive (torch.save's format since torch 1.6; files saved with "
              "_use_new_zipfile_serialization=False are not read)");
  auto reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(
      std::make_shared<BoundedReader>(data, size));
  check_records(*reader, size, what);
  return reader;
}

void check_torch_archive(const char* data, size_t size, const std::string& what) {
  open_torch_archive(data, size, what);
}

}  // namespace ddpx::detail
