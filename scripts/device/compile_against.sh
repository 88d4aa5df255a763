#!/usr/bin/env bash
# Builds what the device check builds (build_targets.txt, CUDA on for sm_90,
# as check.sh configures) against another torch's headers and libraries,
# here on the CPU: the GPU machine's image has torch 2.11 and our venv 2.15,
# and an API that only 2.15 has would fail the check's build there, in the
# first minutes of a lent machine (../../../shared/GPU.md lists what broke
# the first time). Downloads that torch's wheel from PyPI (about 530 MB),
# keeps its include/, share/ and lib/ in the cache, configures a tree of its
# own and builds every target, listing every failure (ninja -k 0). The link
# allows the wheel's own undefined references: the CUDA libraries it loads
# (cuSPARSELt, NVSHMEM, ...) come as wheels of their own, which linking ours
# does not need. Without its Python, no models (they are scripted by it).
#   scripts/device/compile_against.sh [VERSION]      (default 2.11.0)
# Measured 2026-11-30 (8dbd8ea, 2.11.0): every target builds, about 5
# minutes on 2 cores.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
version=${1:-2.11.0}
source "$here/scripts/env.sh"
cache=${DDPX_TORCH_CACHE:-$HOME/.cache/ddpx/torch-$version}
build=$here/build-torch$version
if [ ! -f "$cache/torch/share/cmake/Torch/TorchConfig.cmake" ]; then
  mkdir -p "$cache"
  py=$(python -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
  python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --platform manylinux_2_28_x86_64 "torch==$version" -d "$cache"
  unzip -q -o "$cache"/torch-"$version"-*.whl 'torch/include/*' 'torch/share/*' 'torch/lib/*' \
    -d "$cache"
  rm -f "$cache"/torch-*.whl
fi
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$cache/torch/share/cmake" -DDDPX_BUILD_MODELS=OFF \
  -DCMAKE_CUDA_COMPILER="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" \
  -DDDPX_WITH_CUDA=ON -DDDPX_CUDA_ARCH_LIST=9.0 \
  -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined \
  -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--allow-shlib-undefined >/dev/null
targets=()
for t in $(grep -v '^#' "$here/scripts/device/build_targets.txt"); do
  grep -q "^build $t:" "$build/build.ninja" && targets+=("$t")
done
echo "compile_against.sh: torch $version, targets: ${targets[*]}"
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" -- -k 0
echo "compile_against.sh: every target built against torch $version"
