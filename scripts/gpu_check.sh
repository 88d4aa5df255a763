#!/usr/bin/env bash
# On a machine with a GPU: build (CUDA kernels included), run every test
# labelled gpu, then the GPU benchmarks (ours vs cuDNN). Fails loudly when no
# GPU is visible: these checks must not "pass" by skipping.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DDPX_CMAKE_ARGS="${DDPX_CMAKE_ARGS:-} -DDDPX_WITH_CUDA=ON" "$here/scripts/setup.sh" --all
source "$here/scripts/env.sh"
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device visible")'
nvidia-smi -L || true
(cd "$DDPX_BUILD" && ctest --output-on-failure -L gpu)
"$here/scripts/bench/conv2d" --device cuda "$@"
"$here/scripts/bench/gru" --cuda "$@"
