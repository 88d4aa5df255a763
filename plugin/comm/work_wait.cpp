#include "plugin/comm/work_wait.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>

namespace ddpx::comm::detail {

std::string name_collective(c10d::OpType op, const std::string& what) {
  std::string name = c10d::opTypeToString(op);
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (op == c10d::OpType::UNKNOWN) name = "a collective";
  const std::string head = "waiting for " + name;
  if (what.find(head) != std::string::npos) return what;
  return head + ": " + what;
}

std::string backend_failure_text(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::DistError& e) {
    return e.what_without_backtrace();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  }
}

void wait_named(const c10::intrusive_ptr<c10d::Work>& work) {
  std::string what;
  try {
    work->wait();
    return;
  } catch (...) {
    what = backend_failure_text(std::current_exception());
  }
  C10_THROW_ERROR(DistBackendError, name_collective(work->retrieveOpType(), what));
}

}  // namespace ddpx::comm::detail
