#!/usr/bin/env bash
# On a machine with a GPU and the package registries (an ordinary
# workstation): the usual set-up with the CUDA kernels, then the device check
# (scripts/device/check.sh: the tests labelled gpu, the GPU benchmarks,
# compute-sanitizer) against that build. Fails loudly when no GPU is
# visible: these checks must not "pass" by skipping.
#   scripts/gpu_check.sh [OUT_DIR]      (default: bench_results/gpu-check)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DDPX_CMAKE_ARGS="${DDPX_CMAKE_ARGS:-} -DDDPX_WITH_CUDA=ON" "$here/scripts/setup.sh" --all
source "$here/scripts/env.sh"
DDPX_CHECK_DEPS=0 DDPX_CHECK_BUILD="$DDPX_BUILD" DDPX_CHECK_BUDGET_S="${DDPX_CHECK_BUDGET_S:-3600}" \
  "$here/scripts/device/check.sh" "${1:-$here/bench_results/gpu-check}"
