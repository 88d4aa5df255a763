// A server rank: receives pushes on the Inbox's thread and, on the caller's
// thread, gates them (gate.h), applies them with the optimizer on its shard,
// answers the workers and watches that they are alive (steps 2-6 of the
// protocol in ddpx/ps.h).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <ddpx/ps.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <thread>

#include "plugin/comm/codec_message.h"
#include "plugin/ps/gate.h"
#include "plugin/ps/layout.h"
#include "plugin/ps/server_state.h"
#include "plugin/ps/session_state.h"
#include "plugin/ps/transport.h"
#include "plugin/ps/wire.h"

namespace ddpx::ps {
namespace detail {

using Clock = std::chrono::steady_clock;

class ServerImpl {
 public:
  explicit ServerImpl(Session& s)
      : s_(s),
        k_(s.rank()),
        workers_(s.num_workers()),
        gate_(s.consistency(), workers_, s.options().deterministic),
        inbox_(s.state().comm),
        out_(s.state().wcomm),
        last_heard_(workers_, Clock::now()),
        next_seq_(workers_, 0),
        answered_(workers_, false),
        pull_codec_(comm::MessageCodec::parse(s.options().pull_codec)),
        held_(workers_) {
    at::NoGradGuard no_grad;
    // The shard's segments: copies of this rank's initial values, 1-D.
    for (const auto& sg : s.state().layout.shards[k_]) {
      seg_numel_.push_back(sg.numel);
      segs_.push_back(
          s.params()[sg.param].detach().view(-1).narrow(0, sg.offset, sg.numel).clone());
      segs_.back().requires_grad_(true);  // a leaf the optimizer may hold
    }
    TORCH_CHECK(s.options().make_optimizer,
                "ddpx ps: Options::make_optimizer is not set; the "
                "servers need it to apply gradients");
    opt_ = s.options().make_optimizer(segs_);
    for (auto& group : opt_->param_groups()) base_lr_.push_back(group.options().get_lr());
  }

  ~ServerImpl() {
    if (!thread_.joinable()) return;
    stop_ = true;  // an error before join(): the workers name this server when they time out
    thread_.join();
  }

  ServerStats serve(const std::function<void(const ServerStats&)>& on_update) {
    TORCH_CHECK(!s_.colocated(), "ddpx ps: colocated servers serve on a thread of their own "
                "(Server::start(), then the rank's Worker, then Server::join()): serve() would "
                "wait for ever for this rank's own worker");
    run(on_update);
    return finish();
  }

  void start(const std::function<void(const ServerStats&)>& on_update) {
    TORCH_CHECK(!started_, "ddpx ps: Server::start() called twice");
    started_ = true;
    if (LocalLink* link = s_.state().local.get()) link->attach(&inbox_);
    thread_ = std::thread([this, on_update] {
      try {
        run(on_update);
      } catch (const std::exception& e) {
        error_ = std::current_exception();
        if (LocalLink* link = s_.state().local.get()) {
          link->detach();
          link->fail(std::string("server ") + std::to_string(k_) + ": " + e.what());
        }
      }
    });
  }

  ServerStats join() {
    TORCH_CHECK(started_, "ddpx ps: Server::join() without start()");
    if (thread_.joinable()) thread_.join();
    if (error_) std::rethrow_exception(error_);
    return finish();
  }

  ServerStats restore(const std::string& bytes) {
    TORCH_CHECK(!started_, "ddpx ps: Server::restore() after start()");
    ServerState st = state();
    load_server_state(bytes, st, *opt_);
    stats_ = st.stats;
    next_seq_ = st.next_seq;
    // Every worker computes its next gradient on the restored version.
    for (int w = 0; w < workers_; ++w) {
      gate_.gave(w, stats_.version);
      gate_.set_done(w, next_seq_[w]);
    }
    return stats_;
  }

 private:
  // Steps 2-6 until every worker said BYE or was dropped (or stop_), then
  // the last checkpoint and replies.
  void run(const std::function<void(const ServerStats&)>& on_update) {
    const auto timeout = std::chrono::duration<double>(s_.timeout_s());
    auto last_beat = Clock::now();
    size_t sending = 0;  // replies MPI has not finished
    while (!stop_) {
      // Open MPI moves a large reply (rendezvous: several round trips) only
      // inside MPI calls. While one is in flight, come back within 50 us to
      // drive it: waiting for the next message instead left each reply to
      // the Inbox thread's paced probes, and a worker's wait for its
      // parameters grew by a few of its naps per reply.
      const auto wait = std::chrono::microseconds(sending ? 50 : 20000);
      if (auto m = inbox_.pop(wait)) handle(*m);
      while (auto d = gate_.next(stats_.version)) apply(*d, on_update);
      const auto now = Clock::now();
      drop_silent(now, timeout);
      if (!awaiting_.empty()) release_held();
      if (now - last_beat > timeout / 4) {
        // Workers waiting for a held reply (ssp, sync), or after their BYE
        // for the final list of live workers (Session::share_final), know
        // this server lives.
        for (int w = 0; w < workers_; ++w) {
          if (!lost(w) && !local(w)) out_.send(pack_note(kHeartbeat, -1, 0), rank_of(w), kHeartbeat);
        }
        last_beat = now;
      }
      sending = out_.progress();
      if (gate_.live_count() == 0) break;
    }
    inbox_.stop();
    if (LocalLink* link = s_.state().local.get()) link->detach();
    if (stop_) return;
    if (s_.options().on_checkpoint) checkpoint();
    TORCH_CHECK(out_.drain(timeout), "ddpx ps: server ", k_,
                " could not deliver its last replies within the timeout");
  }

  // The final values into this rank's parameters, for Session::share_final
  // (on the caller's thread: a colocated rank's worker is done with them).
  ServerStats finish() {
    at::NoGradGuard no_grad;
    const auto& shard = s_.state().layout.shards[k_];
    for (size_t i = 0; i < shard.size(); ++i) {
      s_.params()[shard[i].param]
          .view(-1)
          .narrow(0, shard[i].offset, shard[i].numel)
          .copy_(segs_[i]);
    }
    return stats_;
  }

  ServerState state() const {
    ServerState st;
    st.server = k_;
    st.servers = s_.num_servers();
    st.stats = stats_;
    st.next_seq = next_seq_;
    st.segs = segs_;
    return st;
  }

  void checkpoint() { s_.options().on_checkpoint(save_server_state(state(), *opt_)); }

  int rank_of(int worker) const { return s_.state().worker_rank(worker); }
  // This rank's own worker (colocated): reached through the LocalLink.
  bool local(int worker) const { return s_.state().is_local(rank_of(worker)); }

  void send_to(int w, const at::Tensor& bytes, int tag) {
    if (!local(w)) return out_.send(bytes, rank_of(w), tag);
    LocalLink& link = *s_.state().local;
    if (tag == kReply) return link.reply(bytes);
    link.refuse("server " + std::to_string(k_) + " (rank " + std::to_string(k_) +
                ") refused worker " + std::to_string(w) + ": " +
                std::string(static_cast<const char*>(bytes.data_ptr()),
                            static_cast<size_t>(bytes.numel())));
  }

  void handle(const Message& m) {
    const int w = s_.state().worker_of(m.source);
    TORCH_CHECK(w >= 0, "ddpx ps: server ", k_, " got a message (tag ", m.tag, ") from rank ",
                m.source, ", which is not a worker");
    last_heard_[w] = Clock::now();
    if (!gate_.live(w)) return;  // dropped: nothing of it is applied any more
    try {
      switch (m.tag) {
        case kPush:
          return on_push(w, m);
        case kPull:
          parse_note(m.bytes, kPull, w);
          return answer(w);
        case kBye:
          parse_note(m.bytes, kBye, w);
          gate_.gone(w);
          return;
        case kHeartbeat:
          parse_note(m.bytes, kHeartbeat, w);
          return;
        default:
          TORCH_CHECK(false, "ddpx ps: unknown message tag ", m.tag);
      }
    } catch (const c10::Error& e) {
      // A malformed message: refuse it, tell its sender why, go on with the others.
      const std::string why = e.what_without_backtrace();
      std::fprintf(stderr, "[ddpx ps] server %d: refused a message of worker %d (rank %d): %s\n",
                   k_, w, m.source, why.c_str());
      at::Tensor text = at::empty({static_cast<int64_t>(why.size())}, at::kByte);
      std::memcpy(text.data_ptr(), why.data(), why.size());
      send_to(w, text, kError);
      gate_.gone(w);
      lose(w);
    }
  }

  void on_push(int w, const Message& m) {
    Push p = parse_push(m.bytes, w, seg_numel_);
    const bool comp = p.header.flags & kDelayComp;
    TORCH_CHECK(comp == (s_.options().delay_comp > 0), "ddpx ps: a push of worker ", w, " (seq ",
                p.header.seq, ") ", comp ? "carries" : "lacks",
                " the delay-compensation term; this server's delay_comp is ",
                s_.options().delay_comp);
    TORCH_CHECK(p.header.base >= 0 && p.header.base <= stats_.version, "ddpx ps: a push of worker ",
                w, " (seq ", p.header.seq, ") says it was computed on version ", p.header.base,
                " of server ", k_, ", which holds version ", stats_.version);
    stats_.bytes_received += p.bytes;
    for (int64_t n : seg_numel_) stats_.bytes_raw += 4 * n;
    const int64_t id = next_id_++;
    gate_.offer(Ticket{w, p.header.seq, p.header.base, id});
    pending_.emplace(id, std::move(p));
  }

  void apply(const Decision& d, const std::function<void(const ServerStats&)>& on_update) {
    for (const auto& t : d.drop) {
      ++stats_.dropped;
      finish_ticket(t);
    }
    if (d.apply.empty()) return;
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < segs_.size(); ++i) {
      // One gradient as it came; several (sync) summed in worker order, then averaged.
      at::Tensor g = compensated(pending_.at(d.apply[0].id), i);
      if (d.apply.size() > 1) {
        g = g.clone();
        for (size_t j = 1; j < d.apply.size(); ++j) g.add_(compensated(pending_.at(d.apply[j].id), i));
        g.div_(static_cast<double>(d.apply.size()));
      }
      segs_[i].mutable_grad() = g;
    }
    set_learning_rate(d);
    opt_->step();
    for (const auto& t : d.apply) {
      stats_.staleness.add(stats_.version - t.base);
      const auto& h = pending_.at(t.id).header;
      stats_.loss_sum += h.loss;
      stats_.correct += h.correct;
      stats_.samples += h.samples;
    }
    stats_.applied += static_cast<int64_t>(d.apply.size());
    ++stats_.updates;
    ++stats_.version;
    for (const auto& t : d.apply) finish_ticket(t);
    if (on_update) on_update(stats_);
    const int64_t every = s_.options().checkpoint_every;
    if (every > 0 && stats_.updates % every == 0 && s_.options().on_checkpoint) checkpoint();
  }

  // Segment i's gradient of a push; with delay compensation (DC-ASGD)
  // g + lambda * (g * g * w_now - g * g * w_base), the second product as the
  // worker sent it. One rounding per operation, so a segment's elements come
  // out the same whatever the segment's length (tests compare with whole tensors).
  at::Tensor compensated(const Push& p, size_t i) const {
    if (p.comp.empty()) return p.grads[i];
    const at::Tensor& g = p.grads[i];
    const at::Tensor w = segs_[i].detach();
    return g + (g * g * w - p.comp[i]) * s_.options().delay_comp;
  }

  // lr_at(version), or the optimizer's own; with staleness_lr, a gradient
  // applied tau > 0 versions stale gets 1/tau of it (Zhang et al. 2016), so
  // old gradients move the model less. An update of several (sync) is fresh.
  void set_learning_rate(const Decision& d) {
    const auto& o = s_.options();
    const int64_t tau = d.apply.size() == 1 ? stats_.version - d.apply[0].base : 0;
    const double scale = o.staleness_lr && tau > 1 ? 1.0 / static_cast<double>(tau) : 1.0;
    auto& groups = opt_->param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      const double lr = o.lr_at ? o.lr_at(stats_.version) : base_lr_[g];
      groups[g].options().set_lr(lr * scale);
    }
  }

  // The push is done with (applied or dropped): answer it if it asked.
  void finish_ticket(const Ticket& t) {
    next_seq_[t.worker] = t.seq + 1;
    auto it = pending_.find(t.id);
    const bool wants = it->second.header.flags & kAfterPush;
    pending_.erase(it);
    gate_.finished(t.worker);
    if (wants && gate_.live(t.worker)) answer(t.worker);
  }

  // A reply now, or (ssp: the worker is too far ahead) once the slowest live
  // worker has caught up; release_held() sends it.
  void answer(int w) {
    if (gate_.may_start(w)) return reply(w);
    awaiting_.push_back(w);
  }

  // After a push was done with or a worker left: the held replies that may go.
  void release_held() {
    for (size_t i = 0; i < awaiting_.size();) {
      const int w = awaiting_[i];
      if (!gate_.live(w)) {
        awaiting_.erase(awaiting_.begin() + static_cast<std::ptrdiff_t>(i));
      } else if (gate_.may_start(w)) {
        awaiting_.erase(awaiting_.begin() + static_cast<std::ptrdiff_t>(i));
        reply(w);
      } else {
        ++i;
      }
    }
  }

  // The shard at the current version; one buffer per version, shared by
  // every full reply of that version.
  void reply(int w) {
    if (snapshot_version_ != stats_.version || !snapshot_.defined()) {
      const int64_t n = s_.state().layout.shard_numel[k_];
      snapshot_ = at::empty({static_cast<int64_t>(sizeof(ReplyHeader)) + 4 * n}, at::kByte);
      ReplyHeader h;
      h.version = stats_.version;
      std::memcpy(snapshot_.data_ptr(), &h, sizeof h);
      at::Tensor values = snapshot_values();
      int64_t off = 0;
      for (const auto& sg : segs_) {
        values.narrow(0, off, sg.numel()).copy_(sg);
        off += sg.numel();
      }
      snapshot_version_ = stats_.version;
    }
    if (!answered_[w]) {
      // The first reply is exact and tells the worker where it stands (a restored run).
      at::Tensor first = snapshot_.clone();
      ReplyHeader h;
      std::memcpy(&h, first.data_ptr(), sizeof h);
      h.seq = next_seq_[w];
      std::memcpy(first.data_ptr(), &h, sizeof h);
      send_to(w, first, kReply);
      if (pull_codec_.id != comm::WireCodec::None) held_[w] = snapshot_values().clone();
      answered_[w] = true;
    } else if (pull_codec_.id == comm::WireCodec::None) {
      send_to(w, snapshot_, kReply);
    } else {
      send_to(w, delta_reply(w), kReply);
    }
    gate_.gave(w, stats_.version);
  }

  at::Tensor snapshot_values() const {
    const int64_t n = s_.state().layout.shard_numel[k_];
    return snapshot_.narrow(0, sizeof(ReplyHeader), 4 * n).view(at::kFloat);
  }

  // The pull codec's message of (shard - what worker w holds); what it holds
  // then takes the decoded message, exactly as the worker's copy will.
  at::Tensor delta_reply(int w) {
    at::NoGradGuard no_grad;
    at::Tensor& held = held_[w];
    const at::Tensor msg = pull_codec_.encode(snapshot_values() - held, at::Tensor());
    held.add_(pull_codec_.decode(msg, held.numel()));
    at::Tensor out = at::empty({static_cast<int64_t>(sizeof(ReplyHeader)) + msg.numel()}, at::kByte);
    ReplyHeader h;
    h.version = stats_.version;
    h.delta = 1;
    std::memcpy(out.data_ptr(), &h, sizeof h);
    out.narrow(0, sizeof(ReplyHeader), msg.numel()).copy_(msg);
    return out;
  }

  // Dropped (silent or refused), for good: Session::share_final leaves it out.
  bool lost(int w) const { return s_.state().lost[w] != 0; }
  void lose(int w) {
    s_.state().lost[w] = 1;
    out_.abandon(rank_of(w));  // a dead worker's sends never complete
    ++stats_.workers_lost;
  }

  void drop_silent(Clock::time_point now, std::chrono::duration<double> timeout) {
    for (int w = 0; w < workers_; ++w) {
      // This rank's own worker cannot fall silent while its server runs.
      if (!gate_.live(w) || local(w) || now - last_heard_[w] <= timeout) continue;
      gate_.gone(w);
      lose(w);
      // Workers that said BYE are not live either: count them apart.
      const int live = gate_.live_count();
      const int dropped = static_cast<int>(stats_.workers_lost);
      std::fprintf(stderr,
                   "[ddpx ps] server %d: worker %d (rank %d) sent nothing for %.0f s: dropped "
                   "(workers: %d still training, %d finished, %d dropped)\n",
                   k_, w, rank_of(w), timeout.count(), live, workers_ - live - dropped, dropped);
    }
  }

  Session& s_;
  int k_;
  int workers_;
  Gate gate_;
  Inbox inbox_;
  Outbox out_;
  std::vector<Clock::time_point> last_heard_;
  std::vector<int64_t> seg_numel_;
  std::vector<at::Tensor> segs_;
  std::unique_ptr<torch::optim::Optimizer> opt_;
  std::vector<double> base_lr_;  // [param group] the optimizer's own rate
  std::map<int64_t, Push> pending_;
  std::vector<int64_t> next_seq_;  // [worker] seq of its next push
  std::vector<bool> answered_;     // [worker] sent its first reply
  std::vector<int> awaiting_;      // ssp: workers whose reply is held (clock bound)
  comm::MessageCodec pull_codec_;
  std::vector<at::Tensor> held_;   // [worker] what it holds (pull codec only), float32
  int64_t next_id_ = 0;
  ServerStats stats_;
  at::Tensor snapshot_;
  int64_t snapshot_version_ = -1;
  // start() / join()
  bool started_ = false;
  std::atomic<bool> stop_{false};
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace detail

Server::Server(Session& session) {
  TORCH_CHECK(session.is_server(), "ddpx ps: rank ", session.rank(),
              " is a worker; only the first ", session.num_servers(), " ranks serve");
  impl_ = std::make_unique<detail::ServerImpl>(session);
}
Server::~Server() = default;

ServerStats Server::restore(const std::string& state) { return impl_->restore(state); }

ServerStats Server::serve(const std::function<void(const ServerStats&)>& on_update) {
  return impl_->serve(on_update);
}

void Server::start(const std::function<void(const ServerStats&)>& on_update) {
  impl_->start(on_update);
}

ServerStats Server::join() { return impl_->join(); }

}  // namespace ddpx::ps
