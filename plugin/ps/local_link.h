#pragma once
// Colocated servers (Options::servers = kColocated): a rank trains as a
// worker and serves a shard on a thread of its own. What its worker sends
// its own shard, and what that shard answers, goes through this link instead
// of MPI: a push is handed to the server's Inbox as it is, a reply is handed
// back as the tensor the server built (never written again: a new version
// is a new buffer).
#include <ATen/core/Tensor.h>

#include <deque>
#include <mutex>
#include <optional>
#include <string>

#include "plugin/ps/transport.h"

namespace ddpx::ps::detail {

class LocalLink {
 public:
  // The server, while it serves: where the worker's messages go.
  void attach(Inbox* inbox);
  void detach();
  bool attached() const;
  // Worker -> its own server. A c10::Error if the server is not serving.
  void to_server(Message m);

  // Server -> its own worker: a reply, a refusal (the worker's message was
  // wrong; `why` names server and worker) or the server's failure (its
  // thread threw).
  void reply(at::Tensor bytes);
  void refuse(const std::string& why);
  void fail(const std::string& why);
  // Worker: the next reply if one is in; a refusal or failure is a c10::Error.
  std::optional<at::Tensor> take_reply();

 private:
  mutable std::mutex mu_;
  Inbox* inbox_ = nullptr;
  std::deque<at::Tensor> replies_;
  std::string refused_, failed_;
};

}  // namespace ddpx::ps::detail
