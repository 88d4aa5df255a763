#include "plugin/trainer/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <mutex>
#include <unordered_map>

#include "plugin/archive_check.h"
#include "plugin/trainer/optim.h"

namespace ddpx::trainer {
namespace {

constexpr int64_t kFormat = 1;
namespace fs = std::filesystem;

at::Tensor int64_tensor(const std::vector<int64_t>& v) {
  return at::tensor(c10::ArrayRef<int64_t>(v), at::kLong);
}

void broadcast(c10d::ProcessGroup& pg, at::Tensor t, int root = 0) {
  std::vector<at::Tensor> v{std::move(t)};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  pg.broadcast(v, o)->wait();
}

// Every rank's `mine`, on rank 0 (padded to the longest for the gather);
// empty elsewhere.
std::vector<std::string> gather_bytes(c10d::ProcessGroup& pg, const std::string& mine) {
  std::vector<at::Tensor> sizes{at::zeros({pg.getSize()}, at::kLong)};
  sizes[0][pg.getRank()] = static_cast<int64_t>(mine.size());
  pg.allreduce(sizes)->wait();
  const int64_t most = sizes[0].max().item<int64_t>();
  std::vector<at::Tensor> in{at::zeros({most}, at::kByte)};
  std::memcpy(in[0].data_ptr(), mine.data(), mine.size());
  std::vector<std::vector<at::Tensor>> out(1);
  if (pg.getRank() == 0) {
    for (int r = 0; r < pg.getSize(); ++r) out[0].push_back(at::empty({most}, at::kByte));
  }
  c10d::GatherOptions go;
  go.rootRank = 0;
  pg.gather(out, in, go)->wait();
  std::vector<std::string> all;
  for (size_t r = 0; r < out[0].size(); ++r) {
    all.emplace_back(static_cast<const char*>(out[0][r].data_ptr()),
                     static_cast<size_t>(sizes[0][static_cast<int64_t>(r)].item<int64_t>()));
  }
  return all;
}

// Reads archive `ar` into the run's objects; throws naming what does not fit.
void restore(torch::serialize::InputArchive& ar, TrainObjects& t, Position& pos) {
  c10::IValue v;
  ar.read("format", v);
  TORCH_CHECK(v.isInt() && v.toInt() == kFormat, "format ", v, ", this ddpx-train reads ", kFormat);
  // Checked before anything is restored: libtorch's own load of another
  // optimizer's state fails on an internal assert that names neither. (Files
  // from before the kind was written have no entry and skip the check.)
  if (ar.try_read("optimizer_kind", v)) {
    TORCH_CHECK(v.isString() && v.toStringRef() == t.optimizer_kind,
                "it was written with "
                "--optimizer ",
                v.isString() ? v.toStringRef() : "?", ", this run uses --optimizer ",
                t.optimizer_kind);
  }
  // The drop pattern of step t is a function of the schedule and the seed:
  // another one would not continue the run. (Older files: no layer drop.)
  const std::string drop = ar.try_read("layer_drop", v) && v.isString() ? v.toStringRef() : "none";
  TORCH_CHECK(drop == t.layer_drop, "it was written with layer drop '", drop, "', this run uses '",
              t.layer_drop,
              "' (--layer-drop, --pld-gamma, "
              "--layer-drop-pattern, --layer-drop-scale and --seed must match to resume)");
  // The position counts steps of the global batch: another one would not
  // continue the run (at another world size, --global-batch keeps it).
  // (Older files: not recorded, not checked.)
  if (ar.try_read("samples_per_step", v)) {
    c10::IValue w;
    const int64_t written_world = ar.try_read("world", w) ? w.toInt() : 0;
    TORCH_CHECK(v.toInt() == t.samples_per_step, "it was written by ", written_world,
                " rank(s) taking ", v.toInt(), " samples a step, this run takes ",
                t.samples_per_step, " over ", t.world,
                " rank(s); resume with the same global "
                "batch (--global-batch ",
                v.toInt(), ")");
    if (written_world != t.world && t.rank == 0) {
      std::cout << "[ddpx-train] the checkpoint was written by " << written_world
                << " rank(s); going on at " << t.world << " with the same global batches"
                << std::endl;
    }
  }
  at::NoGradGuard no_grad;
  // Model state as two lists (names, tensors): parameter names contain dots,
  // which archive keys must not.
  ar.read("model_names", v);
  const auto names = v.toList();
  c10::IValue tv;
  ar.read("model_tensors", tv);
  const auto tensors = tv.toTensorList();
  TORCH_CHECK(names.size() == tensors.size(), "model_names and model_tensors differ in length");
  std::unordered_map<std::string, at::Tensor> saved;
  for (size_t i = 0; i < names.size(); ++i) saved[names.get(i).toStringRef()] = tensors.get(i);
  auto copy_into = [&](const std::string& name, const at::Tensor& dst) {
    auto it = saved.find(name);
    TORCH_CHECK(it != saved.end(), "it has no entry for '", name,
                "' (a checkpoint of another model?)");
    const at::Tensor& src = it->second;
    TORCH_CHECK(src.sizes() == dst.sizes() && src.scalar_type() == dst.scalar_type(), "'", name,
                "' is ", src.sizes(), " ", src.scalar_type(), " there but ", dst.sizes(), " ",
                dst.scalar_type(), " in the model");
    dst.copy_(src);
  };
  for (const auto& p : t.model.named_parameters()) copy_into(p.name, p.value);
  for (const auto& b : t.model.named_buffers()) copy_into(b.name, b.value);
  torch::serialize::InputArchive opt;
  ar.read("optimizer", opt);
  t.optimizer.load(opt);
  // --shard: every rank's part; this run takes what it owns (all of it,
  // unsharded), at whatever world size the file was written.
  if (ar.try_read("optimizer_shards", v)) {
    const auto shards = v.toTensorList();
    t.sync.load_optimizer_shards(t.optimizer, static_cast<int>(shards.size()), [&](int k) {
      const at::Tensor b = shards.get(k);
      TORCH_CHECK(b.scalar_type() == at::kByte && b.dim() == 1 && b.is_contiguous(),
                  "optimizer_shards ", k, " is not a byte string");
      return std::string(static_cast<const char*>(b.const_data_ptr()),
                         static_cast<size_t>(b.numel()));
    });
  }
  if (t.device != at::kCPU) optimizer_state_to(t.optimizer, t.device);
  at::Tensor order, predictor, rng, where;
  ar.read("gradsync.plan_order", order);
  ar.read("gradsync.predictor", predictor);
  ar.read("gradsync.steps", v);
  // The file says what these tensors are: another dtype or a strided view (an
  // expanded one's storage is smaller than its numel) would be misread.
  TORCH_CHECK(order.scalar_type() == at::kLong && predictor.scalar_type() == at::kDouble,
              "gradsync.plan_order is ", order.scalar_type(), " and gradsync.predictor ",
              predictor.scalar_type(), "; expected Long and Double");
  order = order.contiguous();
  predictor = predictor.contiguous();
  GradSync::State s;
  s.plan_order.assign(order.data_ptr<int64_t>(), order.data_ptr<int64_t>() + order.numel());
  s.predictor.assign(predictor.data_ptr<double>(),
                     predictor.data_ptr<double>() + predictor.numel());
  s.steps = v.toInt();
  // A lossy codec's residuals: this rank's row, cut per parameter. (Saved by
  // another number of ranks: rows and ranks do not match, none is restored.)
  at::Tensor residuals;
  if (ar.try_read("gradsync.residuals", residuals)) {
    const GradSync::State now = t.sync.state();  // its residuals give each parameter's numel
    int64_t total = 0;
    for (const auto& r : now.residuals) total += r.defined() ? r.numel() : 0;
    TORCH_CHECK(total == 0 || residuals.dim() == 2 && residuals.scalar_type() == at::kFloat &&
                                  residuals.size(1) == total,
                "gradsync.residuals is ", residuals.sizes(), " ", residuals.scalar_type(),
                "; this run's codec keeps ", total,
                " float residuals per rank (--codec must "
                "match to resume)");
    if (total == 0) {
      // --codec none now: no error feedback to continue.
    } else if (residuals.size(0) == t.world) {
      const at::Tensor row = residuals[t.rank].contiguous();
      int64_t off = 0;
      for (const auto& r : now.residuals) {
        s.residuals.push_back(row.narrow(0, off, r.numel()).clone());
        off += r.numel();
      }
    } else if (t.rank == 0) {
      std::cerr << "[ddpx-train] the checkpoint's codec residuals are of " << residuals.size(0)
                << " ranks, this run has " << t.world << ": not restored (the run continues, "
                << "not bit for bit)" << std::endl;
    }
  }
  at::Tensor warm_index;
  if (ar.try_read("gradsync.warm_index", warm_index)) {
    ar.read("gradsync.warm_starts", v);
    const auto warm = v.toTensorList();
    TORCH_CHECK(warm_index.scalar_type() == at::kLong && warm_index.dim() == 1 &&
                    warm_index.numel() == static_cast<int64_t>(warm.size()),
                "gradsync.warm_index (", warm_index.sizes(), " ", warm_index.scalar_type(),
                ") does not index the ", warm.size(), " gradsync.warm_starts");
    warm_index = warm_index.contiguous();
    const int64_t n = static_cast<int64_t>(s.plan_order.size());  // GradSync's parameters
    s.warm_starts.resize(n);
    for (size_t i = 0; i < warm.size(); ++i) {
      const int64_t p = warm_index.data_ptr<int64_t>()[i];
      TORCH_CHECK(p >= 0 && p < n, "gradsync.warm_index names parameter ", p, " of ", n);
      s.warm_starts[p] = warm.get(i);
    }
  }
  // --param-dtype's float32 masters (GradSync refuses them without).
  if (ar.try_read("gradsync.masters", v)) {
    for (const auto& m : v.toTensorList()) s.masters.push_back(at::Tensor(m).to(t.device));
  }
  t.sync.load_state(s);
  // Loss scaling's state; a run with it resumes only a file with it.
  const bool scaled = ar.try_read("amp.scaler", v);
  TORCH_CHECK(scaled == (t.scaler != nullptr), "it was written with loss scaling ",
              scaled ? "on" : "off", " (--amp fp16 or --param-dtype fp16), this run has it ",
              t.scaler ? "on" : "off");
  if (scaled) t.scaler->load_state_dict(v);
  ar.read("position", where);
  pos = {where[0].item<int64_t>(), where[1].item<int64_t>(), where[2].item<int64_t>()};
  ar.read("rng", rng);
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng);
  }
  // A run on a GPU: its generator too (dropout's masks), where the file has
  // one (a checkpoint written on the CPU leaves it as seeded).
  at::Tensor device_rng;
  if (t.device.is_cuda() && ar.try_read("rng.cuda", device_rng)) {
    at::Generator g = at::globalContext().defaultGenerator(t.device);
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(device_rng);
  }
}

}  // namespace

// Refuses to start a fresh run over an existing checkpoint (rank 0 decides,
// so ranks on other hosts agree).
void refuse_to_overwrite(const Options& o, c10d::ProcessGroup& pg) {
  at::Tensor exists = at::zeros({1}, at::kLong);
  if (pg.getRank() == 0) exists[0] = fs::exists(o.checkpoint) ? 1 : 0;
  std::vector<at::Tensor> v{exists};
  pg.broadcast(v)->wait();
  TORCH_CHECK(exists[0].item<int64_t>() == 0, "ddpx-train: checkpoint ", o.checkpoint,
              " already exists; pass --resume to continue from it, or choose another "
              "--checkpoint path (a fresh run never overwrites a checkpoint)");
}

void write_durably(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TORCH_CHECK(fd >= 0, "ddpx-train: cannot write checkpoint ", tmp, ": ", std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      TORCH_CHECK(false, "ddpx-train: writing checkpoint ", tmp, " failed: ", std::strerror(e));
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (!synced) ::unlink(tmp.c_str());
  TORCH_CHECK(synced, "ddpx-train: fsync of ", tmp, " failed: ", std::strerror(errno));
  // rename() replaces the old checkpoint in one step; then persist the entry.
  TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "ddpx-train: cannot rename ", tmp,
              " to ", path, ": ", std::strerror(errno));
  const std::string dir =
      fs::path(path).has_parent_path() ? fs::path(path).parent_path().string() : ".";
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void save_checkpoint(const std::string& path, c10d::ProcessGroup& pg, TrainObjects& t,
                     const Position& pos) {
  const GradSync::State s = t.sync.state();
  // Every rank's residuals, one row each (rank 0 gathers them).
  at::Tensor residuals;
  if (!s.residuals.empty() && s.residuals[0].defined()) {
    std::vector<at::Tensor> mine;
    for (const auto& r : s.residuals) mine.push_back(r.cpu());
    std::vector<at::Tensor> in{at::cat(mine)};
    std::vector<std::vector<at::Tensor>> out(1);
    if (pg.getRank() == 0) {
      residuals = at::empty({pg.getSize(), in[0].numel()}, at::kFloat);
      for (int r = 0; r < pg.getSize(); ++r) out[0].push_back(residuals[r]);
    }
    c10d::GatherOptions go;
    go.rootRank = 0;
    pg.gather(out, in, go)->wait();
  }
  // --shard: every rank's part of the optimizer state (rank 0 gathers them).
  const auto shards = t.sharded ? gather_bytes(pg, t.sync.optimizer_shard(t.optimizer))
                                : std::vector<std::string>{};
  if (pg.getRank() != 0) return;
  write_durably(path, serialize(t, pos, s, residuals, shards));
}

std::string serialize(TrainObjects& t, const Position& pos, const GradSync::State& s,
                      const at::Tensor& residuals, const std::vector<std::string>& shards) {
  torch::serialize::OutputArchive ar;
  ar.write("format", c10::IValue(kFormat));
  c10::List<std::string> names;
  c10::List<at::Tensor> tensors;
  for (const auto& p : t.model.named_parameters()) {
    names.push_back(p.name);
    tensors.push_back(p.value.detach().cpu());
  }
  for (const auto& b : t.model.named_buffers()) {
    names.push_back(b.name);
    tensors.push_back(b.value.cpu());
  }
  ar.write("model_names", c10::IValue(names));
  ar.write("model_tensors", c10::IValue(tensors));
  ar.write("optimizer_kind", c10::IValue(t.optimizer_kind));
  ar.write("world", c10::IValue(static_cast<int64_t>(t.world)));
  ar.write("samples_per_step", c10::IValue(t.samples_per_step));
  ar.write("layer_drop", c10::IValue(t.layer_drop));
  torch::serialize::OutputArchive opt;
  t.optimizer.save(opt);  // (sharded: the options, and rank 0's part, which shards replace)
  ar.write("optimizer", opt);
  if (!shards.empty()) {
    c10::List<at::Tensor> bytes;
    for (const auto& b : shards) {
      at::Tensor t8 = at::empty({static_cast<int64_t>(b.size())}, at::kByte);
      std::memcpy(t8.data_ptr(), b.data(), b.size());
      bytes.push_back(t8);
    }
    ar.write("optimizer_shards", c10::IValue(bytes));
  }
  ar.write("gradsync.plan_order", int64_tensor(s.plan_order));
  if (residuals.defined()) ar.write("gradsync.residuals", residuals);
  // PowerSGD's warm starts: the same on every rank, so rank 0's; by parameter.
  std::vector<int64_t> warm_index;
  c10::List<at::Tensor> warm;
  for (size_t p = 0; p < s.warm_starts.size(); ++p) {
    if (!s.warm_starts[p].defined()) continue;
    warm_index.push_back(static_cast<int64_t>(p));
    warm.push_back(s.warm_starts[p].cpu());
  }
  if (!warm_index.empty()) {
    ar.write("gradsync.warm_index", int64_tensor(warm_index));
    ar.write("gradsync.warm_starts", c10::IValue(warm));
  }
  if (!s.masters.empty()) {
    c10::List<at::Tensor> masters;
    for (const auto& m : s.masters) masters.push_back(m.cpu());
    ar.write("gradsync.masters", c10::IValue(masters));
  }
  if (t.scaler) ar.write("amp.scaler", c10::IValue(t.scaler->state_dict()));
  ar.write("gradsync.predictor", at::tensor(c10::ArrayRef<double>(s.predictor), at::kDouble));
  ar.write("gradsync.steps", c10::IValue(s.steps));
  ar.write("position", int64_tensor({pos.step, pos.epoch, pos.batch}));
  ar.write("rng", at::detail::getDefaultCPUGenerator().get_state());
  if (t.device.is_cuda()) {
    ar.write("rng.cuda", at::globalContext().defaultGenerator(t.device).get_state());
  }
  std::string bytes;
  ar.save_to([&bytes](const void* data, size_t n) {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  return bytes;
}

void share_state(c10d::ProcessGroup& pg, int root, TrainObjects& t, Position& pos) {
  std::string bytes;
  if (pg.getRank() == root) bytes = serialize(t, pos, t.sync.state(), at::Tensor());
  at::Tensor size = at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong);
  broadcast(pg, size, root);
  at::Tensor buf = at::empty({size.item<int64_t>()}, at::kByte);
  if (pg.getRank() == root) std::memcpy(buf.data_ptr(), bytes.data(), bytes.size());
  broadcast(pg, buf, root);
  if (pg.getRank() == root) return;
  restore_checkpoint(reinterpret_cast<const char*>(buf.data_ptr()),
                     static_cast<size_t>(buf.numel()),
                     "the state rank " + std::to_string(root) + " shared", t, pos);
}

bool load_checkpoint(const std::string& path, c10d::ProcessGroup& pg, TrainObjects& t,
                     Position& pos) {
  // Rank 0 reads; header {status, size}: 0 none, 1 bytes follow, -1 unreadable.
  at::Tensor header = at::zeros({2}, at::kLong);
  std::string bytes, why;
  if (pg.getRank() == 0 && fs::exists(path)) {
    std::ifstream f(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), {});
    if (!f.good() && !f.eof()) why = "read error";
    header[0] = why.empty() ? 1 : -1;
    header[1] = static_cast<int64_t>(bytes.size());
  }
  broadcast(pg, header);
  const int64_t status = header[0].item<int64_t>();
  TORCH_CHECK(status >= 0, "ddpx-train: cannot read checkpoint ", path, " on rank 0: ", why);
  if (status == 0) return false;
  at::Tensor buf = at::empty({header[1].item<int64_t>()}, at::kByte);
  if (pg.getRank() == 0) std::memcpy(buf.data_ptr(), bytes.data(), bytes.size());
  broadcast(pg, buf);
  restore_checkpoint(reinterpret_cast<const char*>(buf.data_ptr()),
                     static_cast<size_t>(buf.numel()), path, t, pos);
  return true;
}

void restore_checkpoint(const char* data, size_t size, const std::string& name, TrainObjects& t,
                        Position& pos) {
  try {
    ddpx::detail::check_torch_archive(data, size, "its archive");
    torch::serialize::InputArchive ar;
    ar.load_from(data, size, at::Device(at::kCPU));  // (restore() moves what trains elsewhere)
    restore(ar, t, pos);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "ddpx-train: checkpoint ", name,
                " is corrupt, truncated or not this "
                "run's: ",
                e.what_without_backtrace(), " (the file is left as it is)");
  } catch (const std::exception& e) {
    // TorchScript's loader reports a mangled archive (code it cannot compile)
    // as torch::jit::ErrorReport, which is no c10::Error (tests/fuzz).
    TORCH_CHECK(false, "ddpx-train: checkpoint ", name,
                " is corrupt or not a checkpoint: ", e.what(), " (the file is left as it is)");
  }
}

}  // namespace ddpx::trainer
