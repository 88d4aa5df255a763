# Sourced by scripts/sanitize.sh and scripts/fuzz.sh: an instrumented build
# tree beside the normal one, built by clang (Debian's; libFuzzer and the
# sanitizers' run times come with libclang-rt-14-dev), sharing the venv and
# ccache. ddpx_instrumented_tree MODE: address (ASan + UBSan, plus the fuzz
# targets) or thread (TSan); sets DDPX_ITREE to the configured tree.
ddpx_instrumented_tree() {
  local mode=$1 here
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  local pkgs=(clang-14 libclang-rt-14-dev llvm-14) missing=()
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "[sanitize] installing Debian packages: ${missing[*]}"
    local SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
  source "$here/scripts/versions.sh"
  # The venv and Debian's build dependencies come from setup.sh (which also
  # builds the normal tree): run it on a machine that has not yet.
  [ -f "$DDPX_VENV/.ddpx-complete" ] || "$here/scripts/setup.sh"
  DDPX_ITREE="$here/build-${mode/address/asan}"
  DDPX_ITREE=${DDPX_ITREE/build-thread/build-tsan}
  local fuzz=OFF
  [ "$mode" = address ] && fuzz=ON
  if [ ! -f "$DDPX_ITREE/build.ninja" ]; then
    local torch_prefix
    torch_prefix=$("$DDPX_VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
    # No CUDA (the sanitizers check host code), no Python glue or scripted
    # models at build time (a Python that loads an instrumented library
    # needs the run time preloaded; the tests' fixtures do that themselves).
    # TORCH_CUDA_ARCH_LIST: torch's CMake package, finding a CUDA toolkit,
    # would otherwise compile a GPU probe (and fail) even with our CUDA off.
    cmake -S "$here" -B "$DDPX_ITREE" -G Ninja -DTORCH_CUDA_ARCH_LIST=8.0 \
      -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
      -DCMAKE_CXX_COMPILER_LAUNCHER="cmake;-E;env;CCACHE_BASEDIR=$here;CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime;ccache" \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_PREFIX_PATH="$torch_prefix" \
      -DPython3_EXECUTABLE="$DDPX_VENV/bin/python" \
      -DDDPX_WITH_CUDA=OFF -DDDPX_BUILD_PYTHON=OFF -DDDPX_BUILD_MODELS=OFF \
      -DDDPX_SANITIZE="$mode" -DDDPX_BUILD_FUZZ=$fuzz >/dev/null
  fi
}
