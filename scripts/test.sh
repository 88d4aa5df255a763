#!/usr/bin/env bash
# Every test: sets up if needed (idempotent), builds, installs, then ctest.
# Extra arguments go to ctest, e.g. scripts/test.sh -L mpi  or  -R conv
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$here/scripts/setup.sh" --all
source "$here/scripts/env.sh"
cd "$DDPX_BUILD"
# Tests that need more ranks than cores share them: keep ctest serial for the
# multi-rank ones (PROCESSORS is set per test) and parallel up to the cores.
# Without a GPU the gpu-labelled tests would only start, find none and skip
# (about 25 CPU-seconds): they are left out, and ctest says so. A GPU
# machine runs them (scripts/device/check.sh makes their skips failures).
gpu=()
if ! nvidia-smi -L >/dev/null 2>&1; then
  gpu=(-LE gpu)
  echo "test.sh: no GPU here (nvidia-smi -L): the tests labelled gpu are left out"
fi
ctest --output-on-failure -j "$(nproc)" "${gpu[@]}" "$@"
