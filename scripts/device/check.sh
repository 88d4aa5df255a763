#!/usr/bin/env bash
# The device check: one command on the lent GPU machine (see
# ../../README.md, "GPU"). Unpacks device_deps/ (scripts/device/prepare.sh),
# configures against the machine's python3 torch with CUDA on (sm_90 only),
# builds what the checks need with every core, then runs the tests labelled
# gpu, the GPU benchmarks and compute-sanitizer over the op kernels' tests,
# each within its share of the time. Writes OUT_DIR/check.log, one JSON per
# benchmark and OUT_DIR/check.json (each step: status, seconds; the card,
# torch, CUDA). Fails loudly when no GPU is visible: nothing passes by skipping.
#   scripts/device/check.sh OUT_DIR              on the GPU machine
#   scripts/device/check.sh OUT_DIR --rehearse   here: same steps, GPU steps
#                                                report "no GPU", deps not unpacked
# DDPX_CHECK_BUDGET_S (default 540): a step that cannot start with its
# minimum time left is recorded as "not run: out of time" instead of being cut.
# DDPX_CHECK_GROUPS (default build,tests,bench,sanitize,ddp,pip,ncu; also
# benchmode, the conv suite with measured paths, ddpfull, the whole DDP
# suite, and grufull, the whole GRU suite and its TF32 and bfloat16 runs):
# which groups run. At most 8 files come back from a device call: at the end
# every file in OUT_DIR but the log and check.json goes into results.tar.gz.
set -uo pipefail
out=${1:?usage: check.sh OUT_DIR [--rehearse]}
rehearse=0; [ "${2:-}" = --rehearse ] && rehearse=1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$out"; out=$(cd "$out" && pwd)
exec > >(tee -a "$out/check.log") 2>&1
budget=${DDPX_CHECK_BUDGET_S:-540}
start=$SECONDS
build=${DDPX_CHECK_BUILD:-$here/build-gpu}
export here build out  # (read by the functions step() runs in a child bash)
# (At most 8 files come back from the device call: the log, check.json and
# the benchmarks' JSON go to OUT_DIR, the rest stays in /tmp.)
steps=/tmp/ddpx-check-steps.tsv; : >"$steps"
export PYTHONUNBUFFERED=1 DDPX_BENCH_OUT="$out"

left() { echo $((budget - (SECONDS - start))); }
# step NAME MIN_S MAX_S CMD...: runs CMD under `timeout` (at most MAX_S, and
# never past the budget), logs it, records status and seconds.
step() {
  local name=$1 min=$2 max=$3; shift 3
  local l; l=$(left)
  if [ "$l" -lt "$min" ]; then
    echo "=== $name: not run: out of time (${l} s left, needs ${min})"
    printf '%s\tnot run: out of time\t0\n' "$name" >>"$steps"; return 1
  fi
  [ "$max" -gt "$l" ] && max=$l
  echo "=== $name (at $((SECONDS - start)) s, limit ${max} s): $*"
  local t0=$SECONDS rc=0
  if declare -F "$1" >/dev/null; then  # a function of this script: `timeout` runs programs
    timeout --kill-after=10 "$max" bash -c "$(declare -f "$1"); $1" || rc=$?
  else
    timeout --kill-after=10 "$max" "$@" || rc=$?
  fi
  local st=ok
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && st="timed out after ${max} s"
  [ $rc -ne 0 ] && [ "$st" = ok ] && st="failed (exit $rc)"
  echo "=== $name: $st, $((SECONDS - t0)) s"
  printf '%s\t%s\t%s\n' "$name" "$st" "$((SECONDS - t0))" >>"$steps"
  return $rc
}
# A GPU step in a rehearsal: says so, runs nothing.
gpu_step() {
  if [ "$has_gpu" = 1 ]; then step "$@"; return; fi
  echo "=== $1: no GPU (rehearsal): not run"
  printf '%s\tno GPU (rehearsal)\t0\n' "$1" >>"$steps"
}

# --- the machine ----------------------------------------------------------------
{
  date -u +%FT%TZ; uname -a; nproc; free -g | head -2
  nvidia-smi || echo "nvidia-smi: none"
  nvcc --version | tail -2 || echo "nvcc: none"
  g++ --version | head -1; cmake --version | head -1; ninja --version
  echo "CC=${CC:-} CXX=${CXX:-} CUDAHOSTCXX=${CUDAHOSTCXX:-}"; command -v gcc g++ c++
  python3 -c 'import sys, torch; print(sys.executable, torch.__version__, torch.version.cuda, torch.cuda.is_available())'
  command -v compute-sanitizer || echo "compute-sanitizer: none"
} 2>&1
has_gpu=0
python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' && has_gpu=1
if [ "$has_gpu" = 0 ] && [ "$rehearse" = 0 ]; then
  echo "check.sh: FAILED: no CUDA device visible to python3's torch (see the machine above)" >&2
  printf 'gpu visible\tfailed: no CUDA device\t0\n' >>"$steps"
  python3 "$here/scripts/device/summarize.py" "$out" "$steps" || true
  exit 2
fi

# --- what the image lacks (device_deps/) -------------------------------------------
unpack_deps() {
  local d=$here/device_deps
  [ -d "$d/debs" ] || { echo "no $d: run scripts/device/prepare.sh and carry device_deps"; return 1; }
  for deb in "$d"/debs/*.deb; do
    # Never over a file the image has (its own libudev, zlib, ...), and keep
    # merged /usr's lib -> usr/lib links (plain dpkg -x replaces them).
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C / --keep-directory-symlink --skip-old-files
  done
  while read -r link target; do
    [ -e "$link" ] || { mkdir -p "$(dirname "$link")"; ln -s "$target" "$link"; }
  done <"$d/links.txt"
  ldconfig
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ddpx-site "$d"/wheels/*.whl
}
# (DDPX_CHECK_DEPS=0: a machine that has them; scripts/gpu_check.sh.)
if [ "$rehearse" = 0 ] && [ "${DDPX_CHECK_DEPS:-1}" = 1 ]; then
  step deps 10 60 unpack_deps
  export PYTHONPATH=/tmp/ddpx-site${PYTHONPATH:+:$PYTHONPATH}
fi
# No ssh there: Open MPI's launcher must not look for it (one host only).
export OMPI_MCA_plm_rsh_agent=/bin/false OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# A gVisor machine (KINDS.md: the H200s) has no cross-memory attach; the
# shared-memory transport then copies through its buffers instead.
export OMPI_MCA_btl_vader_single_copy_mechanism=none

# The image's CC/CXX (/opt/gcc, a newer GCC over the system's libstdc++)
# link parts of libstdc++ statically: libddpx.so then held its own copies of
# std::call_once's thread-locals, and torch's call_once ran our copy with a
# null callable (SIGSEGV in every CUDA test on the H200, 2026-11-28). Build
# with the system compiler, whose libstdc++ is the one torch loads.
if [ -x /usr/bin/g++ ]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi
# --- configure + build ----------------------------------------------------------------
configure() {
  local prefix; prefix=$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  local cudacxx; cudacxx=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$(command -v python3)" \
    -DCMAKE_CUDA_COMPILER="$cudacxx" -DDDPX_WITH_CUDA=ON -DDDPX_CUDA_ARCH_LIST=9.0 \
    ${DDPX_CHECK_CMAKE_ARGS:-}
}
# What the checks need (build_targets.txt; the Python glue where the image
# has Python's headers).
build_targets() {
  local t targets=()
  for t in $(grep -v '^#' "$here/scripts/device/build_targets.txt"); do
    grep -q "^build $t:" "$build/build.ninja" && targets+=("$t")
  done
  echo "targets: ${targets[*]}"
  cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" || return
  # What the compiler linked in: no libstdc++ symbol may be exported (a
  # copy's facets crashed another library's error message on 2026-11-27).
  grep -m3 "CMAKE_CXX_COMPILER:\|CMAKE_CUDA_HOST_COMPILER:" "$build/CMakeCache.txt"
  local lib
  for lib in "$build"/libddpx.so "$build"/libddpx_cuda.so; do
    echo "$(basename "$lib"): $(nm -DC --defined-only "$lib" | grep -c 'ostream::_M_insert') ostream::_M_insert symbols exported (0 expected); $(readelf -d "$lib" | grep -c NEEDED) needed"
  done
}
# At most 8 files come back from a device call: everything in OUT_DIR but
# the log and check.json goes into one archive.
pack_results() {
  local f files=()
  for f in "$out"/*; do
    case $(basename "$f") in check.log | check.json | results.tar.gz) ;; *) files+=("$(basename "$f")") ;; esac
  done
  [ ${#files[@]} -gt 0 ] || return 0
  tar -czf "$out/results.tar.gz" -C "$out" "${files[@]}" && (cd "$out" && rm -rf -- "${files[@]}")
  echo "results.tar.gz: ${files[*]}"
}
bail() { python3 "$here/scripts/device/summarize.py" "$out" "$steps"; pack_results; exit 1; }
# DDPX_CHECK_GROUPS: which groups run (a rerun on the warm machine names the
# ones the first call did not reach; the build is still there).
groups=",${DDPX_CHECK_GROUPS:-build,tests,bench,sanitize,ddp,pip,ncu},"
want() { [[ "$groups" == *",$1,"* ]]; }
if want build; then
  [ -f "$build/build.ninja" ] || step configure 30 120 configure || bail
  step build 60 420 build_targets || bail
fi
export DDPX_LIB=$build/libddpx.so DDPX_REQUIRE_GPU=1 DDPX_BUILD=$build

# --- the pip package's CUDA build: the wheel built there (scikit-build-core is
# in the image) on the CPU cores while the GPU tests run, installed outside
# the checkout, then its ops on CUDA tensors (the `pip` group) ----------------------------
pip_build() {
  local nvcc; nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  rm -rf /tmp/ddpx-wheel /tmp/ddpx-pkg
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) nice python3 -m pip wheel -q --no-build-isolation \
    --no-deps -w /tmp/ddpx-wheel -Cbuild-dir=/tmp/ddpx-pip-build -Ccmake.define.DDPX_WITH_CUDA=ON \
    -Ccmake.define.DDPX_CUDA_ARCH_LIST=9.0 -Ccmake.define.CMAKE_CUDA_COMPILER="$nvcc" "$here" &&
    ls -l /tmp/ddpx-wheel &&
    python3 -m pip install -q --no-index --no-deps --target /tmp/ddpx-pkg /tmp/ddpx-wheel/*.whl
}
pip_check() {
  local t0=$SECONDS
  while [ ! -f /tmp/ddpx-pip.rc ]; do sleep 2; done
  echo "(waited $((SECONDS - t0)) s for the wheel)"; tail -20 /tmp/ddpx-pip.log
  [ "$(cat /tmp/ddpx-pip.rc)" = 0 ] || return 1
  (cd /tmp && env -u DDPX_LIB PYTHONPATH="/tmp/ddpx-pkg:${PYTHONPATH:-}" \
     python3 "$here/scripts/device/pip_cuda_check.py")
}
rm -f /tmp/ddpx-pip.rc
if want pip && [ "$has_gpu" = 1 ]; then
  (pip_build >/tmp/ddpx-pip.log 2>&1; echo $? >/tmp/ddpx-pip.rc) &
fi

# --- correctness: the tests labelled gpu, four at a time (the trainer's, the
# longest, among them) ---------------------------------------------------------------------
if want tests; then
  gpu_step "ctest -L gpu" 30 240 ctest --test-dir "$build" -L gpu -j 4 --output-on-failure
fi
# --- speed: ours vs cuDNN on the same card, ratios per case -------------------------------
if want bench; then
  # The quick suite as users call the op (host overhead included): the
  # rule's ratios and our kernels' own where the rule hands a pass to cuDNN
  gpu_step "bench conv2d --device cuda --quick" 30 120 python3 "$here/scripts/bench/conv2d" \
    --device cuda --quick
  # The seed's and the depthwise cases as CUDA graph replays: the kernels
  # without the host's share (issue 59's figures against the copy floor and
  # cuDNN / ATen's conv_depthwise2d); --aa: the peer against itself, the
  # noise a ratio carries on the card
  gpu_step "bench conv2d --device cuda --graphs --aa" 30 150 python3 "$here/scripts/bench/conv2d" \
    --device cuda --graphs --aa --only "seed 3x3 512" "seed 5x5 512" "seed 3x3 1024" \
    "seed 5x5 1024" "seed 3x3 2048" "seed 5x5 2048" "depthwise 3x3 c32" "depthwise 3x3 c64" \
    "depthwise 5x5 c32" "depthwise 7x7 c96" "depthwise 7x7 c96 cl" "depthwise 3x3 c64 cl" \
    "depthwise 3x3 s2 c96" "depthwise 3x3 s2 c96 cl" "depthwise 5x5 s2 c144 cl"
  # the persistent kernels (persist_ratio) and the per-step ones (step_ratio)
  # beside the rule's choice, 16 cases of issue 59's grid
  gpu_step "bench gru --cuda --quick" 30 120 python3 "$here/scripts/bench/gru" --cuda --quick
  # ddpx-train with --amp fp16 / bf16 and bf16 parameters against float32 on
  # the card: samples/s and test accuracy (LeNet, HAN; issue 63)
  gpu_step "bench train --amp-only --device cuda --quick" 30 180 \
    python3 "$here/scripts/bench/train" --amp-only --device cuda --quick
fi
if want pip; then
  gpu_step "pip wheel (CUDA) + import" 20 200 pip_check
fi
# --- compute-sanitizer over the op kernels' tests (the cases marked `sanitizer`:
# under the sanitizer every launch is instrumented) -------------------------------------------
if want sanitize; then
  py_tests=(tests/python/test_tiled_conv2d_cuda.py tests/python/test_fused_gru_cuda.py
            tests/python/test_int8_codec_cuda.py)
  for tool in memcheck racecheck; do
    gpu_step "compute-sanitizer $tool" 30 120 compute-sanitizer --tool "$tool" --error-exitcode 99 --report-api-errors no \
      python3 -m pytest -q -x -p no:cacheprovider -m sanitizer "${py_tests[@]/#/$here/}"
  done
fi
if want ddp; then
  # --trace: GradSync's own trace of gradsync_gloo per model (2 files, 25 KB
  # for the cnn on the CPU; OUT_DIR then holds 7 of the 8 files a call brings
  # back), for the cnn's 2.12x over DDP on the H200 that nothing on the CPU
  # explains.
  gpu_step "bench ddp --device cuda --quick" 60 200 python3 "$here/scripts/bench/ddp" --quick \
    --device cuda --trace "$out"
  # PyTorch's DDP with our comm hooks on CUDA buckets (the worker's stream,
  # "none" staged in chunks) against DDP's own allreduce and its fp16 hook,
  # over Gloo
  gpu_step "bench ddp_hooks --device cuda --backend gloo --quick" 40 120 \
    python3 "$here/scripts/bench/ddp_hooks" --device cuda --backend gloo --quick
  # ddpx-train against the DDP script on the GPU, float32 and --amp bf16
  # (issue 60's training row)
  gpu_step "bench train --cuda-ddp --quick" 40 150 python3 "$here/scripts/bench/train" --cuda-ddp --quick
fi
# Not in the default groups, for a second call on the warm machine when the
# first left time (DDPX_CHECK_GROUPS=benchmode,ddpfull): the conv suite with
# the path measured per case (DDPX_CONV_PATH=benchmark, cuDNN's benchmark mode
# on for F.conv2d too), and the whole DDP suite on CUDA.
if want benchmode; then
  gpu_step "bench conv2d --device cuda --path benchmark" 30 150 \
    python3 "$here/scripts/bench/conv2d" --device cuda --path benchmark
fi
if want ddpfull; then
  gpu_step "bench ddp --device cuda" 60 540 python3 "$here/scripts/bench/ddp" --device cuda
fi
if want grufull; then
  gpu_step "bench gru --cuda --quick --tf32" 30 120 python3 "$here/scripts/bench/gru" --cuda --quick --tf32
  gpu_step "bench gru --cuda --quick --dtype bfloat16" 30 120 python3 "$here/scripts/bench/gru" --cuda --quick --dtype bfloat16
  gpu_step "bench gru --cuda" 60 420 python3 "$here/scripts/bench/gru" --cuda
fi
# --- Nsight Compute on the persistent GRU kernels (last: it runs only when
# the steps before left it time): speed of light, occupancy, warp stalls,
# memory, in the log -------------------------------------------------------------------------
if want ncu; then
  gpu_step "ncu persistent GRU" 30 120 ncu --target-processes all -k regex:persistent \
    --launch-count 4 --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 "$here/scripts/device/ncu_gru.py"
  # the small-filter conv kernels: the seed's 3x3 2048^2 and a channels_last
  # depthwise 7x7, forward + backward (achieved bandwidth, stalls)
  gpu_step "ncu conv small kernels" 30 120 ncu --target-processes all \
    -k "regex:small_|nhwc_|sum_partials" --launch-count 8 --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 "$here/scripts/device/ncu_conv.py"
fi

python3 "$here/scripts/device/summarize.py" "$out" "$steps"
rc=$?
pack_results
exit $rc
