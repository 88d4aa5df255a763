#!/usr/bin/env bash
# PyTorch's own distributed test suite (DistributedTest._DistTestBase, shipped
# in the wheel) under mpirun -np 3, on ddpx_mpi and on Gloo side by side:
# counts per backend and every test whose outcome differs, with the reason.
#   scripts/torch_suite.sh                       # all ~300 tests, both backends
#   scripts/torch_suite.sh -k allgather --np 2   # a subset
# Options: scripts/torch_suite/run.py --help. Results: bench_results/torch_suite/.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$here/scripts/setup.sh" >/dev/null
source "$here/scripts/env.sh"
cd "$here"
exec python "$here/scripts/torch_suite/run.py" "$@"
