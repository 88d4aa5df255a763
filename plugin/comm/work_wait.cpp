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

void wait_named(const c10::intrusive_ptr<c10d::Work>& work) {
  std::string what;
  try {
    work->wait();
    return;
  } catch (const c10::DistError& e) {
    what = e.what_without_backtrace();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    what = e.what();
  }
  const std::string named = name_collective(work->retrieveOpType(), what);
  C10_THROW_ERROR(DistBackendError, named);
}

}  // namespace ddpx::comm::detail
