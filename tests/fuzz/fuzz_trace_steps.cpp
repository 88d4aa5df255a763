// GradSync's trace window ("a:b", GradSyncOptions::trace_steps and
// DDPX_TRACE_STEPS): any text; a window that parses is non-empty and 1-based.
#include <ddpx/grad_sync.h>

#include "hooks/profiler.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;  // "" means: take DDPX_TRACE_STEPS from the environment
  const std::string steps(reinterpret_cast<const char*>(data), size);
  ddpx::fuzz::expect_ok_or_error([&] {
    const auto c = ddpx::hooks::TraceConfig::from(ddpx::GradSyncOptions().trace_steps(steps));
    TORCH_INTERNAL_ASSERT(c.first_step >= 1 && c.first_step <= c.last_step, "'", steps, "'");
  });
  return 0;
}
