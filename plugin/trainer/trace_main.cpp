// ddpx-trace: reads a job's flight-recorder dumps (one file per rank, as
// ddpx::comm::dump_trace and a timed-out collective write them, PyTorch's
// format) and prints the same one-screen diagnosis ddpx-train prints after
// a failed step.
//   ddpx-trace analyze DIR [--prefix PREFIX] [--world N]
#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <iostream>
#include <map>
#include <numeric>
#include <regex>

#include "plugin/comm/flight_dump.h"
#include "plugin/comm/flight_report.h"

namespace fs = std::filesystem;
using namespace ddpx::comm::detail;

int main(int argc, char** argv) {
  CLI::App app{"ddpx-trace: the flight recorder's dumps, read back"};
  app.require_subcommand(1);
  auto* analyze = app.add_subcommand(
      "analyze", "the one-screen diagnosis of a directory of dumps, one file per rank");
  std::string dir, prefix;
  int world = 0;
  analyze->add_option("dir", dir, "the directory (e.g. that of TORCH_FR_DUMP_TEMP_FILE)")
      ->required()
      ->check(CLI::ExistingDirectory);
  analyze->add_option("--prefix", prefix,
                      "file name prefix before the rank (default: the one the files share)");
  analyze
      ->add_option("--world", world,
                   "ranks in the job (default: those the dumps' groups name); a rank "
                   "without a file is reported as not answering")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  // <prefix><rank>, as PyTorch's analyzer reads them.
  const std::regex named(R"((.*?)(\d+)$)");
  std::map<std::string, std::map<int, fs::path>> by_prefix;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file() || !std::regex_match(name, m, named)) continue;
    if (!prefix.empty() && m[1].str() != prefix) continue;
    by_prefix[m[1].str()][std::stoi(m[2].str())] = e.path();
  }
  if (by_prefix.size() != 1) {
    std::cerr << "ddpx-trace: " << dir << ": "
              << (by_prefix.empty() ? "no dump files (<prefix><rank>)"
                                    : "files of several prefixes: choose one with --prefix")
              << std::endl;
    return 2;
  }
  std::map<int, FrSnapshot> snaps;
  try {
    for (const auto& [rank, path] : by_prefix.begin()->second) {
      FrDump d = fr_parse_dump(fr_read_file(path.string()), path.string());
      snaps[rank] = std::move(d.snap);
    }
  } catch (const c10::Error& e) {
    std::cerr << "ddpx-trace: " << e.what_without_backtrace() << std::endl;
    return 2;
  }
  std::vector<int> expected;
  if (world > 0) {
    expected.resize(world);
    std::iota(expected.begin(), expected.end(), 0);
  }
  std::cout << fr_analyze(snaps, expected).text;
  return 0;
}
