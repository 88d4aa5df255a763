#include "plugin/ps/server_state.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <sstream>

#include "plugin/archive_check.h"

namespace ddpx::ps::detail {
namespace {

constexpr int64_t kFormat = 1;

at::Tensor longs(const std::vector<int64_t>& v) {
  return at::tensor(c10::ArrayRef<int64_t>(v), at::kLong);
}

// Each entry into a fresh tensor: reading into a defined one set_()s it,
// which the archive's storage does not allow.
at::Tensor read(torch::serialize::InputArchive& ar, const std::string& key) {
  at::Tensor t;
  ar.read(key, t);
  return t;
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

}  // namespace

std::string save_server_state(const ServerState& s, torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive ar;
  const ServerStats& st = s.stats;
  ar.write("format", c10::IValue(kFormat));
  ar.write("where", longs({s.server, s.servers, static_cast<int64_t>(s.next_seq.size()),
                           static_cast<int64_t>(s.segs.size())}));
  ar.write("counters", longs({st.version, st.applied, st.dropped, st.updates, st.bytes_received,
                              st.bytes_raw, st.workers_lost}));
  ar.write("reported", at::tensor({st.loss_sum, st.correct, st.samples}, at::kDouble));
  ar.write("staleness",
           longs(st.staleness.counts.empty() ? std::vector<int64_t>{0} : st.staleness.counts));
  ar.write("next_seq", longs(s.next_seq));
  for (size_t i = 0; i < s.segs.size(); ++i)
    ar.write("seg" + std::to_string(i), s.segs[i].detach());
  torch::serialize::OutputArchive opt_ar;
  opt.save(opt_ar);
  ar.write("optimizer", opt_ar);
  std::ostringstream os;
  ar.save_to(os);
  return os.str();
}

void load_server_state(const std::string& bytes, ServerState& s, torch::optim::Optimizer& opt) {
  ddpx::detail::check_torch_archive(bytes.data(), bytes.size(), "ddpx ps: a server checkpoint");
  torch::serialize::InputArchive ar;
  std::istringstream is(bytes);
  ar.load_from(is);
  c10::IValue v;
  ar.read("format", v);
  TORCH_CHECK(v.isInt() && v.toInt() == kFormat, "ddpx ps: a server checkpoint of format ", v,
              "; this build reads format ", kFormat);
  const auto where = to_vector(read(ar, "where"));
  TORCH_CHECK(where.size() == 4 && where[0] == s.server && where[1] == s.servers &&
                  where[2] == static_cast<int64_t>(s.next_seq.size()) &&
                  where[3] == static_cast<int64_t>(s.segs.size()),
              "ddpx ps: the checkpoint was written by server ", where.at(0), " of ", where.at(1),
              " for ", where.at(2), " workers and ", where.at(3), " segments; this is server ",
              s.server, " of ", s.servers, " with ", s.next_seq.size(), " workers and ",
              s.segs.size(), " segments");
  const auto c = to_vector(read(ar, "counters"));
  ServerStats& st = s.stats;
  st.version = c.at(0);
  st.applied = c.at(1);
  st.dropped = c.at(2);
  st.updates = c.at(3);
  st.bytes_received = c.at(4);
  st.bytes_raw = c.at(5);
  st.workers_lost = c.at(6);
  const at::Tensor t = read(ar, "reported");
  st.loss_sum = t[0].item<double>();
  st.correct = t[1].item<double>();
  st.samples = t[2].item<double>();
  st.staleness.counts = to_vector(read(ar, "staleness"));
  s.next_seq = to_vector(read(ar, "next_seq"));
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < s.segs.size(); ++i) {
    const at::Tensor seg = read(ar, "seg" + std::to_string(i));
    TORCH_CHECK(seg.numel() == s.segs[i].numel(), "ddpx ps: segment ", i, " of the checkpoint has ",
                seg.numel(), " elements; this server's has ", s.segs[i].numel(),
                " (another model?)");
    s.segs[i].copy_(seg);
  }
  torch::serialize::InputArchive opt_ar;
  ar.read("optimizer", opt_ar);
  opt.load(opt_ar);
}

}  // namespace ddpx::ps::detail
