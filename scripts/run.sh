#!/usr/bin/env bash
# The main job: sets up if needed (idempotent: apt, venv, build, scripted
# models), then trains LeNet (convolutions through ddpx::tiled_conv2d) on the
# generated 10-class image set with 2 ranks under mpirun over ddpx_mpi, with
# GradSync averaging gradients during backward. Prints progress, the test
# accuracy and GradSync's profile summary.
#   scripts/run.sh                        # defaults below
#   scripts/run.sh --steps 600 --codec int8 --model build/torchscript_models/han.pt
# Extra flags go to ddpx-train (later flags win); ddpx-train --help lists them.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$here/scripts/setup.sh"
source "$here/scripts/env.sh"
np=${DDPX_NP:-2}
exec mpirun -np "$np" --oversubscribe --bind-to none \
  ddpx-train --model "$DDPX_BUILD/torchscript_models/lenet.pt" \
  --steps 300 --batch-size 32 --lr 0.05 --lr-schedule cosine --warmup-steps 20 \
  --log-every 50 "$@"
