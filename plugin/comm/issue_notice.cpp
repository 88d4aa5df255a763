#include "plugin/comm/issue_notice.h"

#include <utility>

namespace ddpx::comm::detail {

namespace {
thread_local std::function<void()>* tls_notice = nullptr;
}  // namespace

std::function<void()>* set_issue_notice(std::function<void()>* notice) {
  return std::exchange(tls_notice, notice);
}

void notify_last_issue() {
  if (tls_notice == nullptr) return;
  std::function<void()>* n = std::exchange(tls_notice, nullptr);
  if (*n) (*n)();
}

}  // namespace ddpx::comm::detail
