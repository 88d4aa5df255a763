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
ctest --output-on-failure -j "$(nproc)" "$@"
