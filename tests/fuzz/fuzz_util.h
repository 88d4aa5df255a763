#pragma once
// What every fuzz target shares: the parsers under test report bad input as
// c10::Error (TORCH_CHECK), which is the expected outcome of most inputs;
// anything else that escapes -- another exception type, a crash, a
// sanitizer report -- is a finding and ends the run.
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace ddpx::fuzz {

// Runs `f`, swallowing the parsers' own errors.
template <typename F>
void expect_ok_or_error(F&& f) {
  try {
    f();
  } catch (const c10::Error&) {
  }
}

// Seeds that are easiest made by the code under test itself (binary formats):
// with DDPX_FUZZ_WRITE_SEEDS=DIR, a target's LLVMFuzzerInitialize writes them
// there and exits (scripts/fuzz.sh --write-seeds refreshes tests/fuzz/corpus).
inline const char* seed_dir() { return std::getenv("DDPX_FUZZ_WRITE_SEEDS"); }

inline void write_seed(const std::string& name, const std::string& bytes) {
  const std::filesystem::path dir(seed_dir());
  std::filesystem::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary).write(bytes.data(), bytes.size());
}

}  // namespace ddpx::fuzz
