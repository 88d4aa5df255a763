#!/usr/bin/env bash
# scripts/sanitize.sh [address|thread] [ctest args...]
#
# Builds the library, ddpx-train and the C++ tests instrumented (build-asan:
# AddressSanitizer + UndefinedBehaviorSanitizer + LeakSanitizer, and the fuzz
# targets; build-tsan: ThreadSanitizer) and runs the C++ tests, the
# multi-rank ones under mpirun included, plus (address) each fuzz target's
# smoke. Python tests are left out: they run inside an uninstrumented Python.
# Any report fails the test it comes from. Run-time options and the
# suppressions of LibTorch / Open MPI findings: cmake/ddpxSanitize.cmake and
# tests/sanitize/.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mode=${1:-address}
[ $# -gt 0 ] && shift
case "$mode" in address|thread) ;; *) echo "usage: $0 [address|thread] [ctest args...]" >&2; exit 2;; esac
source "$here/scripts/instrumented_tree.sh"
ddpx_instrumented_tree "$mode"
cmake --build "$DDPX_ITREE" -j "${DDPX_JOBS:-$(nproc)}"
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
cd "$DDPX_ITREE"
# ThreadSanitizer multiplies run time and memory; its pass runs one test at a
# time, without the tests whose Python fixture loads the library (pylib:
# Python crashes with TSan's run time preloaded).
jobs=$(nproc); exclude='python|gpu'
[ "$mode" = thread ] && jobs=1 && exclude='python|gpu|pylib'
ctest --output-on-failure -j "$jobs" -LE "$exclude" "$@"
