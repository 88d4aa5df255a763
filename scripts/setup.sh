#!/usr/bin/env bash
# One-time (idempotent) set-up: system packages, the pinned PyTorch venv
# outside the checkout, then configure + build. A second run only rebuilds
# what changed, so it finishes in seconds.
#   scripts/setup.sh         what the main job needs: libddpx.so (and its CUDA
#                            kernels where a GPU is present), ddpx-train, the
#                            Python glue and the scripted models
#   scripts/setup.sh --all   everything (tests, benchmark drivers, the CUDA
#                            kernels wherever nvcc is), then installs
set -euo pipefail
all=0
[ "${1:-}" = --all ] && all=1
# Each phase that did something says how long it took (the README's
# first-run figures come from these lines).
t0=$SECONDS
phase() { echo "[setup] $1: $((SECONDS - t0)) s"; t0=$SECONDS; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
source scripts/versions.sh

# --- system packages (Debian) ------------------------------------------------
apt_pkgs=(openmpi-bin libopenmpi-dev ninja-build cmake g++ ccache libgtest-dev
          libgloo-dev libcli11-dev nlohmann-json3-dev iproute2 procps
          nftables)  # nftables: the lossy link of tests/python/test_trainer_network.py
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  phase "Debian packages"
fi

# --- Python venv with the pinned CUDA-enabled torch wheel ---------------------
stamp="$DDPX_VENV/.ddpx-complete"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$DDPX_TORCH_VERSION $DDPX_PY_PACKAGES" ]; then
  echo "[setup] creating $DDPX_VENV (torch $DDPX_TORCH_VERSION)"
  mkdir -p "$(dirname "$DDPX_VENV")"
  "$DDPX_PYTHON" -m venv "$DDPX_VENV"
  "$DDPX_VENV/bin/python" -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  "$DDPX_VENV/bin/python" -m pip install -q "torch==$DDPX_TORCH_VERSION" $DDPX_PY_PACKAGES
  echo "$DDPX_TORCH_VERSION $DDPX_PY_PACKAGES" >"$stamp"
  phase "virtual environment (torch wheel)"
fi

# --- configure + build --------------------------------------------------------
# ccache keyed relative to the checkout (base_dir), so every clone and
# worktree on this machine reuses the same objects. The sloppiness lets it
# cache the translation units that use the precompiled headers (DDPX_PCH).
launcher="${CMAKE_COMMAND:-cmake};-E;env;CCACHE_BASEDIR=$here;CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime;ccache"
if [ ! -f "$DDPX_BUILD_DIR/build.ninja" ]; then
  # (Importing torch takes seconds: only when configuring.)
  torch_prefix=$("$DDPX_VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  cmake -S . -B "$DDPX_BUILD_DIR" -G Ninja \
    -DCMAKE_CXX_COMPILER_LAUNCHER="$launcher" \
    -DCMAKE_CUDA_COMPILER_LAUNCHER="$launcher" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_prefix" \
    -DPython3_EXECUTABLE="$DDPX_VENV/bin/python" \
    -DCMAKE_INSTALL_PREFIX="$here/$DDPX_BUILD_DIR/install" \
    ${DDPX_CMAKE_ARGS:-}
  phase "configure"
fi
jobs=${DDPX_JOBS:-$(nproc)}
if [ "$all" = 1 ]; then
  cmake --build "$DDPX_BUILD_DIR" -j "$jobs"
  cmake --install "$DDPX_BUILD_DIR" >/dev/null
else
  # The main job's targets only: the tests and benchmark drivers are most of
  # a fresh build. The CUDA kernels only where a GPU can run them.
  targets=(ddpx ddpx-train ddpx_models)
  grep -q '^build ddpx_python:' "$DDPX_BUILD_DIR/build.ninja" && targets+=(ddpx_python)
  if grep -q '^build ddpx_cuda:' "$DDPX_BUILD_DIR/build.ninja" && nvidia-smi -L >/dev/null 2>&1; then
    targets+=(ddpx_cuda)
  fi
  cmake --build "$DDPX_BUILD_DIR" -j "$jobs" --target "${targets[@]}"
fi
phase "build"
echo "[setup] done: source scripts/env.sh to use the build"
