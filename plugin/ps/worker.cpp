// A worker rank: pushes its gradients, receives every server's shard into a
// buffer of its own and swaps the values into the parameters only at pull()
// (steps 1, 2, 4-6 of the protocol in ddpx/ps.h). A thread of its own sends
// the heartbeats, so a long step is never mistaken for a dead worker.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <ddpx/ps.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>

#include "plugin/archive_check.h"
#include "plugin/comm/codec_message.h"
#include "plugin/comm/mpi_env.h"
#include "plugin/comm/wait_pacer.h"
#include "plugin/ps/heartbeat.h"
#include "plugin/ps/layout.h"
#include "plugin/ps/session_state.h"
#include "plugin/ps/transport.h"
#include "plugin/ps/wire.h"

namespace ddpx::ps {
namespace detail {

using comm::detail::WaitPacer;
using Clock = std::chrono::steady_clock;

class WorkerImpl {
 public:
  explicit WorkerImpl(Session& s)
      : s_(s),
        w_(s.worker_index()),
        codec_(comm::MessageCodec::parse(s.options().codec)),
        out_(s.state().comm),
        rng_(static_cast<uint32_t>(1000 + w_)),
        pull_codec_(comm::MessageCodec::parse(s.options().pull_codec)) {
    const int K = s.num_servers();
    TORCH_CHECK(!s.colocated() || s.state().local->attached(), "ddpx ps: rank ", s.rank(),
                " serves a shard too (colocated): call Server::start() before making its Worker");
    local_ = s.colocated() ? s.rank() : -1;
    buffers_.resize(K);
    held_.resize(K);
    received_.assign(K, 0);
    requests_.assign(K, MPI_REQUEST_NULL);
    versions_.assign(K, 0);
    residuals_.resize(K);
    for (int k = 0; k < K; ++k) {
      // Room for a full reply (float32 values) and for a delta one.
      const int64_t n = s.state().layout.shard_numel[k];
      buffers_[k] = at::empty(
          {static_cast<int64_t>(sizeof(ReplyHeader)) + std::max(4 * n, pull_codec_.message_bytes(n))},
          at::kByte);
      residuals_[k].resize(s.state().layout.shards[k].size());
    }
    heartbeat_ = std::make_unique<Heartbeat>(s.state().comm, w_, K, local_, s.timeout_s());
  }

  ~WorkerImpl() {
    // Ended with a pull in flight (an error): take the receives back, so MPI
    // never writes into freed buffers. A receive that already matched a
    // reply (a large one half way in from a server that then stopped) cannot
    // be cancelled and may never complete: give it a second, then leak the
    // buffers and leave the rest to MPI_Abort at exit. Waiting on it hung a
    // worker whose server was SIGSTOPped mid-reply.
    for (auto& r : requests_) {
      if (r == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&r);
      const auto deadline = Clock::now() + std::chrono::seconds(1);
      int done = 0;
      while (MPI_Test(&r, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done &&
             Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (!done) {
        comm::detail::MpiEnv::get().mark_broken("ddpx ps: a pull never completed");
        for (const auto& b : buffers_) new at::Tensor(b);
        return;
      }
    }
  }

  void pull() {
    const PullMode mode = s_.options().pull;
    if (mode == PullMode::Inconsistent && installed_) {
      // Whatever shards came in since the last step go in, each asked for
      // again at once; the others stay as they are. Never waits.
      for (int k = 0; k < s_.num_servers(); ++k) {
        const bool done = test_reply(k);
        take_notes(k);  // a refusal is an error now, not at finish()
        if (!done) continue;
        install_shard(k);
        request_pull_from(k);
      }
      return;
    }
    if (!waiting_) request_pull();
    wait_replies();
    install();
    if (mode != PullMode::AfterPush) request_pull();
  }

  void push(double loss, double correct, double samples) {
    TORCH_CHECK(!finished_, "ddpx ps: push after finish()");
    TORCH_CHECK(!(waiting_ && s_.options().pull == PullMode::AfterPush),
                "ddpx ps: push() twice without pull() in between");
    if (const int64_t d = s_.options().max_push_delay_us; d > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(rng_() % d));
    }
    out_.progress();
    const auto& params = s_.params();
    const auto& layout = s_.state().layout;
    for (int k = 0; k < s_.num_servers(); ++k) {
      std::vector<at::Tensor> payloads;
      const auto& segs = layout.shards[k];
      for (size_t i = 0; i < segs.size(); ++i) {
        const at::Tensor& g = params[segs[i].param].grad();
        at::Tensor x = g.defined() ? g.detach()
                                         .reshape(-1)
                                         .narrow(0, segs[i].offset, segs[i].numel)
                                         .to(at::kFloat)
                                         .contiguous()
                                   : at::zeros({segs[i].numel}, at::kFloat);
        at::Tensor& e = residuals_[k][i];
        if (codec_.id != comm::WireCodec::None && !e.defined()) e = at::zeros_like(x);
        at::Tensor msg = codec_.encode(x, e);
        if (s_.options().delay_comp > 0) msg = with_delay_comp(msg, x, params[sg_param(k, i)], segs[i]);
        payloads.push_back(std::move(msg));
        stats_.bytes_raw += 4 * segs[i].numel;
      }
      PushHeader h;
      h.worker = w_;
      h.codec = static_cast<int32_t>(codec_.id);
      h.chunk = codec_.chunk;
      h.ratio = codec_.ratio;
      h.seq = seq_;
      h.base = versions_[k];
      h.flags = (s_.options().pull == PullMode::AfterPush ? kAfterPush : 0) |
                (s_.options().delay_comp > 0 ? kDelayComp : 0);
      h.loss = loss;
      h.correct = correct;
      h.samples = samples;
      at::Tensor msg = pack_push(h, payloads);
      stats_.bytes_sent += msg.numel();
      send(k, msg, kPush);
    }
    // The gradient is the servers' now: leave .grad unset, as
    // optimizer.zero_grad(set_to_none=true) would, so the next backward
    // starts from nothing instead of adding to what was pushed.
    for (const auto& p : params) p.mutable_grad().reset();
    ++seq_;
    ++stats_.pushes;
    if (s_.options().pull == PullMode::AfterPush) post_receives();
  }

  int64_t version() const { return versions_[0]; }
  int64_t start_step() const { return start_step_; }

  // Worker::save_residuals: the push count, the codec, and every (server,
  // segment) residual in order (none before the first push or without
  // error feedback).
  std::string save_residuals() const {
    torch::serialize::OutputArchive ar;
    ar.write("format", c10::IValue(kResidualFormat));
    ar.write("pushes", c10::IValue(seq_));
    ar.write("codec", c10::IValue(s_.options().codec));
    c10::List<at::Tensor> all;
    for (const auto& per_server : residuals_) {
      for (const auto& e : per_server) {
        if (e.defined()) all.push_back(e);
      }
    }
    ar.write("residuals", c10::IValue(all));
    std::ostringstream os;
    ar.save_to(os);
    return os.str();
  }

  bool restore_residuals(const std::string& bytes) {
    TORCH_CHECK(installed_, "ddpx ps: restore_residuals before the first pull (which says "
                "which step the servers restored this worker to)");
    ddpx::detail::check_torch_archive(bytes.data(), bytes.size(),
                                      "ddpx ps: a worker's residuals");
    torch::serialize::InputArchive ar;
    std::istringstream is(bytes);
    ar.load_from(is);
    c10::IValue format, pushes, codec, saved;
    ar.read("format", format);
    TORCH_CHECK(format.isInt() && format.toInt() == kResidualFormat, "ddpx ps: worker residuals "
                "of format ", format, "; this build reads format ", kResidualFormat);
    ar.read("pushes", pushes);
    ar.read("codec", codec);
    ar.read("residuals", saved);
    TORCH_CHECK(codec.isString() && codec.toStringRef() == s_.options().codec, "ddpx ps: worker ",
                w_, "'s residuals were saved with push codec '", codec,
                "'; this run pushes with '", s_.options().codec, "'");
    if (!pushes.isInt() || pushes.toInt() != start_step_) return false;
    const auto list = saved.toTensorList();
    size_t n = 0;
    for (const auto& per_server : residuals_) n += per_server.size();
    TORCH_CHECK(list.empty() || list.size() == n, "ddpx ps: worker ", w_, "'s residuals hold ",
                list.size(), " segments; this model's layout has ", n);
    std::vector<std::vector<at::Tensor>> restored(residuals_.size());
    size_t i = 0;
    for (size_t k = 0; k < residuals_.size(); ++k) {
      restored[k].resize(residuals_[k].size());  // saved before the first push: nothing owed
      for (size_t j = 0; j < residuals_[k].size() && !list.empty(); ++j, ++i) {
        const at::Tensor e = list.get(i);
        const int64_t want = s_.state().layout.shards[k][j].numel;
        TORCH_CHECK(e.dim() == 1 && e.scalar_type() == at::kFloat && e.numel() == want,
                    "ddpx ps: worker ", w_, "'s residual ", i, " is ", e.sizes(), " ",
                    e.scalar_type(), "; its segment holds ", want, " float elements");
        restored[k][j] = e.clone();
      }
    }
    residuals_ = std::move(restored);  // all checked: nothing half restored
    return true;
  }

  void finish() {
    if (finished_) return;
    heartbeat_->stop();
    if (waiting_) {
      wait_replies();
      install();
    }
    const std::chrono::duration<double> limit(s_.timeout_s());
    for (int k = 0; k < s_.num_servers(); ++k) send(k, pack_note(kBye, w_, seq_), kBye);
    TORCH_CHECK(out_.drain(limit), "ddpx ps: worker ", w_,
                " could not deliver its last messages "
                "to the servers within ",
                limit.count(), " s");
    finished_ = true;
  }

  WorkerStats stats() const { return stats_; }

 private:
  int sg_param(int k, size_t i) const { return s_.state().layout.shards[k][i].param; }

  // DC-ASGD: the codec's message followed by g * g * w_base of the segment
  // (float32), g the gradient as the server will decode it and w_base the
  // values it was computed on (the parameters change only at pull()).
  at::Tensor with_delay_comp(const at::Tensor& msg, const at::Tensor& x, const at::Tensor& param,
                             const Segment& sg) const {
    at::NoGradGuard no_grad;
    const at::Tensor g = codec_.id == comm::WireCodec::None ? x : codec_.decode(msg, sg.numel);
    const at::Tensor base = param.detach().reshape(-1).narrow(0, sg.offset, sg.numel);
    const at::Tensor comp = (g * g * base).contiguous();
    at::Tensor out = at::empty({msg.numel() + 4 * sg.numel}, at::kByte);
    out.narrow(0, 0, msg.numel()).copy_(msg);
    std::memcpy(out.data_ptr<uint8_t>() + msg.numel(), comp.data_ptr<float>(), 4 * sg.numel);
    return out;
  }

  // To server k: through MPI, or to this rank's own server (colocated) in memory.
  void send(int k, const at::Tensor& bytes, int tag) {
    if (k != local_) return out_.send(bytes, k, tag);
    s_.state().local->to_server(Message{s_.rank(), tag, bytes});
  }

  void post_receive(int k) {
    if (k == local_) {
      local_pending_ = true;
    } else {
      DDPX_MPI_CHECK(MPI_Irecv(buffers_[k].data_ptr(), static_cast<int>(buffers_[k].numel()),
                               MPI_BYTE, k, kReply, s_.state().wcomm, &requests_[k]));
    }
    waiting_ = true;
  }

  bool pending(int k) const { return k == local_ ? local_pending_ : requests_[k] != MPI_REQUEST_NULL; }

  void post_receives() {
    for (int k = 0; k < s_.num_servers(); ++k) post_receive(k);
  }

  void request_pull_from(int k) {
    send(k, pack_note(kPull, w_, seq_), kPull);
    post_receive(k);
  }

  void request_pull() {
    for (int k = 0; k < s_.num_servers(); ++k) request_pull_from(k);
  }

  // Takes a server's ERROR or HEARTBEAT if one is there; true if heard from it.
  bool take_notes(int k) {
    if (k == local_) return true;  // a refusal or failure shows in test_reply
    bool heard = false;
    for (int tag : {kError, kHeartbeat}) {
      int flag = 0;
      MPI_Status st;
      DDPX_MPI_CHECK(MPI_Iprobe(k, tag, s_.state().wcomm, &flag, &st));
      if (!flag) continue;
      int count = 0;
      DDPX_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &count));
      std::string text(static_cast<size_t>(count), '\0');
      DDPX_MPI_CHECK(
          MPI_Recv(text.data(), count, MPI_BYTE, k, tag, s_.state().wcomm, MPI_STATUS_IGNORE));
      TORCH_CHECK(tag != kError, "ddpx ps: server ", k, " (rank ", k, ") refused worker ", w_, ": ",
                  text);
      heard = true;
    }
    return heard;
  }

  void wait_replies() {
    const auto t_start = Clock::now();
    const std::chrono::duration<double> timeout(s_.timeout_s());
    std::vector<Clock::time_point> heard(s_.num_servers(), t_start);
    auto pacer = WaitPacer(t_start);
    while (true) {
      const auto t0 = Clock::now();
      bool all = true;
      for (int k = 0; k < s_.num_servers(); ++k) {
        if (!pending(k) || test_reply(k)) continue;
        all = false;
        if (take_notes(k)) heard[k] = t0;
        TORCH_CHECK(t0 - heard[k] <= timeout, "ddpx ps: server ", k, " (rank ", k,
                    ") sent nothing for ", timeout.count(), " s (DDPX_TIMEOUT_S) while worker ", w_,
                    " waited for its parameters: the server died or is frozen");
      }
      if (all) break;
      const auto nap = pacer.after_test(t0, Clock::now());
      if (nap.count() > 0) std::this_thread::sleep_for(nap);
    }
    waiting_ = false;
    stats_.wait_us += std::chrono::duration<double, std::micro>(Clock::now() - t_start).count();
  }

  // Tests server k's pending reply; once it is in, notes its length.
  bool test_reply(int k) {
    if (k == local_) {
      auto reply = s_.state().local->take_reply();
      if (!reply) return false;
      buffers_[k] = std::move(*reply);  // the server's buffer, never written again
      received_[k] = buffers_[k].numel();
      local_pending_ = false;
      return true;
    }
    int done = 0;
    MPI_Status st;
    DDPX_MPI_CHECK(MPI_Test(&requests_[k], &done, &st));
    if (done) {
      int count = 0;
      DDPX_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &count));
      received_[k] = count;
    }
    return done != 0;
  }

  // Every server's reply is in: the parameters take them all at once.
  void install() {
    for (int k = 0; k < s_.num_servers(); ++k) install_shard(k);
    installed_ = true;
  }

  // Server k's reply is in its buffer: its values go into the parameters.
  void install_shard(int k) {
    at::NoGradGuard no_grad;
    const auto& params = s_.params();
    ReplyHeader h;
    std::memcpy(&h, buffers_[k].data_ptr(), sizeof h);
    TORCH_CHECK(h.magic == kMagic && h.kind == kReply, "ddpx ps: server ", k,
                " sent a reply with a bad header (magic ", h.magic, ", kind ", h.kind, ")");
    versions_[k] = h.version;
    if (!installed_) {
      // The first reply says which step this worker is at (restored servers).
      if (k == 0) start_step_ = seq_ = h.seq;
      TORCH_CHECK(h.seq == start_step_, "ddpx ps: server ", k, " says worker ", w_, " is at step ",
                  h.seq, ", server 0 says ", start_step_,
                  " (were the servers restored from checkpoints of different steps?)");
    }
    const int64_t n = s_.state().layout.shard_numel[k];
    const int64_t payload = h.delta ? pull_codec_.message_bytes(n) : 4 * n;
    TORCH_CHECK(h.delta == 0 || (h.delta == 1 && pull_codec_.id != comm::WireCodec::None),
                "ddpx ps: server ", k, " sent a reply with delta = ", h.delta, " (pull codec ",
                pull_codec_.spec(), ")");
    TORCH_CHECK(received_[k] == static_cast<int64_t>(sizeof(ReplyHeader)) + payload,
                "ddpx ps: server ", k, "'s reply has ", received_[k], " bytes; ",
                sizeof(ReplyHeader) + payload, " expected (", n, " values, ",
                h.delta ? "a " + pull_codec_.spec() + " delta" : std::string("float32"), ")");
    const at::Tensor body = buffers_[k].narrow(0, sizeof(ReplyHeader), payload);
    at::Tensor values;
    if (pull_codec_.id == comm::WireCodec::None) {
      values = body.view(at::kFloat);
    } else if (!h.delta) {
      held_[k] = body.view(at::kFloat).clone();
      values = held_[k];
    } else {
      TORCH_CHECK(held_[k].defined(), "ddpx ps: server ", k,
                  " sent a delta before the full values it is a delta of");
      held_[k].add_(pull_codec_.decode(body, n));  // as the server did to its copy
      values = held_[k];
    }
    ++stats_.pulls;
    stats_.pull_bytes += payload;
    stats_.pull_bytes_raw += 4 * n;
    int64_t off = 0;
    for (const auto& sg : s_.state().layout.shards[k]) {
      params[sg.param]
          .view(-1)
          .narrow(0, sg.offset, sg.numel)
          .copy_(values.narrow(0, off, sg.numel));
      off += sg.numel;
    }
  }

  Session& s_;
  int w_;
  comm::MessageCodec codec_;
  Outbox out_;
  std::mt19937 rng_;
  comm::MessageCodec pull_codec_;
  std::vector<at::Tensor> buffers_;
  std::vector<at::Tensor> held_;       // [server] what this worker holds (pull codec only)
  std::vector<int64_t> received_;      // [server] bytes of the reply in buffers_
  std::vector<MPI_Request> requests_;
  std::vector<int64_t> versions_;
  std::vector<std::vector<at::Tensor>> residuals_;  // [server][segment]
  std::unique_ptr<Heartbeat> heartbeat_;
  int local_ = -1;  // colocated: this rank, whose shard is reached through the LocalLink
  bool local_pending_ = false;
  static constexpr int64_t kResidualFormat = 1;
  int64_t seq_ = 0;
  int64_t start_step_ = 0;
  bool installed_ = false;
  bool waiting_ = false;
  bool finished_ = false;
  WorkerStats stats_;
};

}  // namespace detail

Worker::Worker(Session& session) {
  TORCH_CHECK(session.is_worker(), "ddpx ps: rank ", session.rank(),
              " is a server; workers are ranks ", session.num_servers(), " and up");
  impl_ = std::make_unique<detail::WorkerImpl>(session);
}
Worker::~Worker() = default;
void Worker::pull() { impl_->pull(); }
void Worker::push(double loss, double correct, double samples) {
  impl_->push(loss, correct, samples);
}
int64_t Worker::version() const { return impl_->version(); }
int64_t Worker::start_step() const { return impl_->start_step(); }
void Worker::finish() { impl_->finish(); }
std::string Worker::save_residuals() const { return impl_->save_residuals(); }
bool Worker::restore_residuals(const std::string& bytes) {
  return impl_->restore_residuals(bytes);
}
WorkerStats Worker::stats() const { return impl_->stats(); }

}  // namespace ddpx::ps
