#include "plugin/ps/local_link.h"

#include <c10/util/Exception.h>

#include <utility>

namespace ddpx::ps::detail {

void LocalLink::attach(Inbox* inbox) {
  std::lock_guard<std::mutex> lock(mu_);
  inbox_ = inbox;
}

void LocalLink::detach() {
  std::lock_guard<std::mutex> lock(mu_);
  inbox_ = nullptr;
}

bool LocalLink::attached() const {
  std::lock_guard<std::mutex> lock(mu_);
  return inbox_ != nullptr;
}

void LocalLink::to_server(Message m) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(failed_.empty(), "ddpx ps: this rank's server failed: ", failed_);
  TORCH_CHECK(inbox_, "ddpx ps: this rank's server is not serving (colocated servers: "
              "Server::start() before the Worker trains, Server::join() after Worker::finish())");
  inbox_->post(std::move(m));
}

void LocalLink::reply(at::Tensor bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  replies_.push_back(std::move(bytes));
}

void LocalLink::refuse(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (refused_.empty()) refused_ = why;
}

void LocalLink::fail(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.empty()) failed_ = why;
}

std::optional<at::Tensor> LocalLink::take_reply() {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(refused_.empty(), "ddpx ps: ", refused_);
  TORCH_CHECK(failed_.empty(), "ddpx ps: this rank's server failed: ", failed_);
  if (replies_.empty()) return std::nullopt;
  at::Tensor out = std::move(replies_.front());
  replies_.pop_front();
  return out;
}

}  // namespace ddpx::ps::detail
