#!/usr/bin/env bash
# The main job. Sets up if needed (idempotent), then runs a short, real
# demonstration under mpirun: ddpx_mpi against Gloo, allreduce bandwidth and
# overlap with compute. (The trainer, ddpx-train, replaces this when it lands.)
# Extra arguments are passed to the benchmark, e.g. scripts/run.sh --quick
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$here/scripts/setup.sh"
source "$here/scripts/env.sh"
exec "$here/scripts/bench/allreduce" "$@"
