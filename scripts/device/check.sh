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
#   scripts/device/check.sh OUT_DIR --rehearse   here: the build, then each GPU
#                                                step's command dry (dry() below),
#                                                deps not unpacked
# DDPX_CHECK_BUDGET_S (default 540): a step that cannot start with its
# minimum time left is recorded as "not run: out of time" instead of being cut.
# DDPX_CHECK_GROUPS (default build,tests,bench,sanitize,ddp,pip,ncu; also
# benchmode, the conv suite with measured paths, ddpfull, the whole DDP
# suite, and grufull, the whole GRU suite and its bfloat16 run):
# which groups run. DDPX_CHECK_RESUME=1: a second call on the warm machine,
# which runs only what the first had no time for. At most 8 files come back
# from a device call: at the end every file in OUT_DIR but the log and
# check.json goes into results.tar.gz.
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
steps=/tmp/ddpx-check-steps.tsv
# DDPX_CHECK_RESUME=1 (the second call, on the warm machine): the steps the
# last call ran (passed, failed or cut by their limit) are not run again;
# those it had no time left for run now, in the same order. On a fresh
# machine (no record of a last call) it is a first call.
prev=/tmp/ddpx-check-steps.prev.tsv; : >"$prev"
if [ "${DDPX_CHECK_RESUME:-0}" = 1 ] && [ -f "$steps" ]; then cp "$steps" "$prev"; fi
: >"$steps"
export PYTHONUNBUFFERED=1 DDPX_BENCH_OUT="$out"

left() { echo $((budget - (SECONDS - start))); }
# step NAME MIN_S MAX_S CMD...: runs CMD under `timeout` (at most MAX_S, and
# never past the budget), logs it, records status and seconds.
step() {
  local name=$1 min=$2 max=$3; shift 3
  local before
  before=$(awk -F'\t' -v n="$name" '$1 == n && $2 !~ /^not run/ {s = $2} END {print s}' "$prev")
  if [ -n "$before" ]; then
    before=${before#last call: }
    echo "=== $name: ran in the last call ($before): not run again"
    printf '%s\tlast call: %s\t0\n' "$name" "$before" >>"$steps"; return 0
  fi
  local l; l=$(left)
  if [ "$l" -lt "$min" ]; then
    echo "=== $name: not run: out of time (${l} s left, needs ${min})"
    printf '%s\tnot run: out of time\t0\n' "$name" >>"$steps"; return 1
  fi
  [ "$max" -gt "$l" ] && max=$l
  echo "=== $name (at $((SECONDS - start)) s, limit ${max} s): $*"
  # (When the step's limit comes: a command that can end by itself first,
  # with what it has, reads this; the limit then kills the rest.)
  export DDPX_STEP_DEADLINE=$(($(date +%s) + max - 15))
  local t0=$SECONDS rc=0
  if declare -F "$1" >/dev/null; then  # a function of this script: `timeout` runs programs
    timeout --kill-after=10 "$max" bash -c "$(declare -f "$1"); \"\$@\"" bash "$@" || rc=$?
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
# A GPU step; in a rehearsal, its command dry (below) instead.
gpu_step() {
  if [ "$has_gpu" = 1 ]; then step "$@"; return; fi
  local name=$1; shift 3
  echo "=== $name: no GPU (rehearsal): dry: $*"
  local rc=0
  dry "$@" || rc=$?
  local st="no GPU (rehearsal): arguments ok"
  [ $rc -eq 3 ] && st="no GPU (rehearsal): not rehearsed"
  [ $rc -ne 0 ] && [ $rc -ne 3 ] && st="dry run failed (exit $rc)"
  echo "=== $name: $st"
  printf '%s\t%s\t0\n' "$name" "$st" >>"$steps"
}
# What a rehearsal runs of a GPU step's command, without the device: the
# benchmarks parse and check their arguments (DDPX_BENCH_DRY=1), the tests
# are listed and collected, the ncu workloads compiled.
dry() {
  case "$1" in
    python3) DDPX_BENCH_DRY=1 "$@" ;;
    gpu_tests) ctest --test-dir "$build" -N -L gpu | tail -1 ;;
    sanitizer_run) python3 -m pytest -q -p no:cacheprovider --collect-only -m sanitizer \
                     "${sanitizer_tests[@]/#/$here/}" | tail -1 ;;
    ncu) python3 -m py_compile "${@: -1}" && echo "${@: -1}: compiles" ;;
    *) echo "(not rehearsed: $1 needs the device)"; return 3 ;;
  esac
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
  step deps 10 60 unpack_deps || bail
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
# DDPX_CHECK_GROUPS: which groups run (default build,tests,bench,sanitize,
# ddp,pip,ncu). The steps run in the order of what they are worth to the
# open issues, whatever their group, so that the budget cuts the least
# valuable: the tests, each op's quick benchmark and ncu over its kernels
# (the GRU's, then the conv's), the GRU's with TF32, GradSync's DDP bench, the wheel, memcheck, the training
# runs, the graph replays, racecheck, the hooks bench.
groups=",${DDPX_CHECK_GROUPS:-build,tests,bench,sanitize,ddp,pip,ncu},"
want() { [[ "$groups" == *",$1,"* ]]; }
# (A machine without the build -- a second call that found a fresh one --
# builds whatever the groups.)
if want build || [ ! -f "$build/libddpx.so" ]; then
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
# (A resumed call reuses the last call's wheel, built or still building.)
if want pip && [ "$has_gpu" = 1 ] && [ ! -f /tmp/ddpx-pip.rc ] && ! pgrep -f ddpx-pip-build >/dev/null; then
  (pip_build >/tmp/ddpx-pip.log 2>&1; echo $? >/tmp/ddpx-pip.rc) &
fi

# The tests labelled gpu, four at a time beside the trainer's two halves
# (the longest; COST: started first); each ends by the step's deadline
# (reported as a timeout, with its output) rather than the step's kill
# taking ctest's report with it.
gpu_tests() {
  ctest --test-dir "$build" -L gpu -j 6 --output-on-failure \
    --stop-time "$(date -d "@$DDPX_STEP_DEADLINE" +%H:%M:%S)"
}
# compute-sanitizer over the op kernels' tests (the cases marked `sanitizer`:
# every launch is instrumented). memcheck without the caching allocator,
# whose blocks would hide an overrun into a neighbouring tensor.
sanitizer_tests=(tests/python/test_tiled_conv2d_cuda.py tests/python/test_fused_gru_cuda.py
                 tests/python/test_int8_codec_cuda.py)
export SANITIZER_TESTS="${sanitizer_tests[*]/#/$here/}"  # (step's child shell: no arrays)
sanitizer_run() {
  local tool=$1
  # (Its presence turns the caching off, whatever its value: set for memcheck only.)
  if [ "$tool" = memcheck ]; then export PYTORCH_NO_CUDA_MEMORY_CACHING=1; fi
  # shellcheck disable=SC2086  # (the paths have no spaces: the checkout's)
  compute-sanitizer --tool "$tool" \
    --error-exitcode 99 --report-api-errors no python3 -m pytest -q -x -p no:cacheprovider \
    -m sanitizer $SANITIZER_TESTS
}
# ddpx-train runs in the benchmarks: one that fails or hangs fails its case
# after this many seconds, and the next runs.
run_timeout=100

# --- correctness --------------------------------------------------------------------------
if want tests; then
  gpu_step "ctest -L gpu" 200 330 gpu_tests
fi
# The wheel's build (every core, niced) beside the benchmarks would be noise
# in their host-side timings: it has usually ended with the tests; else
# wait for it a little.
wait_for_wheel() {
  local t0=$SECONDS
  while [ ! -f /tmp/ddpx-pip.rc ] && pgrep -f ddpx-pip-build >/dev/null &&
        [ $((SECONDS - t0)) -lt 60 ]; do
    sleep 2
  done
  echo "=== (waited $((SECONDS - t0)) s for the wheel's build to end before the benchmarks)"
}
if [ "$has_gpu" = 1 ] && want bench && want pip; then wait_for_wheel; fi
# --- speed, ops: ours vs cuDNN on the same card, ratios per case (issue 59), each
# op's quick benchmark then Nsight Compute over its kernels (ncu never had time at the
# end of two lent sessions' budget, 2026-11-28 and 2026-11-30): speed of light,
# occupancy, warp stalls, memory, in the log; the clocks left as they are (the card
# is shared: METHOD.md); the second call of each case, which the workloads bracket
# with cudaProfilerStart/Stop. The GRU first: after the 2026-11-30 run its staging
# keeps 8 loads in flight per thread instead of one, without a division per element
# (kernels/common/gru_persistent.h: by our count, L2 latency was most of batch 16's
# time; ncu's warp stalls say); with a 480 s first call the GRU's two steps fit after
# the tests, the conv's open the second call ------------------------------------------------
if want bench; then
  # the persistent kernels (persist_ratio) and the per-step ones (step_ratio)
  # beside the rule's choice, 16 cases of issue 59's grid
  gpu_step "bench gru --cuda --quick" 60 150 python3 "$here/scripts/bench/gru" --cuda --quick
fi
if want ncu; then
  # the persistent GRU kernels at H256 and H1024
  gpu_step "ncu persistent GRU" 60 120 ncu --clock-control none --profile-from-start off \
    --target-processes all -k regex:persistent --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 "$here/scripts/device/ncu_gru.py"
fi
if want bench; then
  # The quick suite as users call the op (host overhead included): the
  # rule's ratios and our kernels' own where the rule hands a pass to cuDNN
  gpu_step "bench conv2d --device cuda --quick" 40 120 python3 "$here/scripts/bench/conv2d" \
    --device cuda --quick
fi
if want ncu; then
  # the small-filter conv kernels: the seed's 3x3 2048^2, a channels_last
  # depthwise 7x7 and the NCHW depthwise 3x3 that lost to cuDNN (1.25-1.43x),
  # forward + backward (achieved bandwidth, stalls)
  gpu_step "ncu conv small kernels" 60 120 ncu --clock-control none --profile-from-start off \
    --target-processes all -k "regex:small_|nhwc_|sum_partials" --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 "$here/scripts/device/ncu_conv.py"
fi

if want bench; then
  # The GRU rule's choice with cuDNN's TF32 on (PyTorch's default), which the
  # rule's batch <= 4 cases assume still favour ours (ops/fused_gru_cuda_path.h)
  gpu_step "bench gru --cuda --quick --tf32" 30 120 python3 "$here/scripts/bench/gru" --cuda --quick --tf32
fi
# --- speed, GradSync on CUDA buckets against DDP (issue 60) ---------------------------------
if want ddp; then
  # --focus: DDP, GradSync over Gloo on one and two groups (two buckets
  # in flight each) and one bucket at a time (serial_ratio), and over
  # ddpx_mpi, 20 timed steps x 3 rounds (--quick's 3 steps x 1 round on
  # 2026-11-30 swung more than the differences); --trace: GradSync's own
  # trace of gradsync_gloo per model (2 files).
  gpu_step "bench ddp --device cuda --focus" 60 240 python3 "$here/scripts/bench/ddp" --focus \
    --models cnn,many520 --device cuda --trace "$out"
fi
if want pip; then
  gpu_step "pip wheel (CUDA) + import" 20 200 pip_check
fi
if want sanitize; then
  gpu_step "compute-sanitizer memcheck" 30 120 sanitizer_run memcheck
fi
if want bench; then
  # ddpx-train with --amp fp16 / bf16 and bf16 parameters against float32 on
  # the card: samples/s and test accuracy (LeNet, HAN; issue 63)
  gpu_step "bench train --amp-only --device cuda --quick" 90 200 \
    python3 "$here/scripts/bench/train" --amp-only --device cuda --quick --run-timeout $run_timeout
fi
if want ddp; then
  # ddpx-train against the DDP script on the GPU, float32 and --amp bf16
  # (issue 60's training row)
  gpu_step "bench train --cuda-ddp --quick" 90 200 python3 "$here/scripts/bench/train" \
    --cuda-ddp --quick --run-timeout $run_timeout
fi
if want bench; then
  # The seed's and the depthwise cases as CUDA graph replays: the kernels
  # without the host's share (issue 59's figures against the copy floor and
  # cuDNN / ATen's conv_depthwise2d); --aa: the peer against itself, the
  # noise a ratio carries on the card
  gpu_step "bench conv2d --device cuda --graphs --aa" 60 150 python3 "$here/scripts/bench/conv2d" \
    --device cuda --graphs --aa --only "seed 3x3 512" "seed 5x5 512" "seed 3x3 1024" \
    "seed 5x5 1024" "seed 3x3 2048" "seed 5x5 2048" "depthwise 3x3 c32" "depthwise 3x3 c64" \
    "depthwise 5x5 c32" "depthwise 7x7 c96" "depthwise 7x7 c96 cl" "depthwise 3x3 c64 cl" \
    "depthwise 3x3 s2 c96" "depthwise 3x3 s2 c96 cl" "depthwise 5x5 s2 c144 cl" \
    "depthwise 7x7 c384 14" "depthwise 7x7 c768 7"
fi
if want sanitize; then
  gpu_step "compute-sanitizer racecheck" 60 120 sanitizer_run racecheck
fi
if want ddp; then
  # PyTorch's DDP with our comm hooks on CUDA buckets (the worker's stream,
  # "none" staged in chunks) against DDP's own allreduce and its fp16 hook,
  # over Gloo
  gpu_step "bench ddp_hooks --device cuda --backend gloo --quick" 40 120 \
    python3 "$here/scripts/bench/ddp_hooks" --device cuda --backend gloo --quick
fi
# Not in the default groups, for a call on the warm machine when the others
# left time (DDPX_CHECK_GROUPS=benchmode,ddpfull,grufull): the conv suite with
# the path measured per case (DDPX_CONV_PATH=benchmark, cuDNN's benchmark mode
# on for F.conv2d too), the whole DDP suite on CUDA, the whole GRU suite and
# its bfloat16 run.
if want benchmode; then
  gpu_step "bench conv2d --device cuda --path benchmark" 30 150 \
    python3 "$here/scripts/bench/conv2d" --device cuda --path benchmark
fi
if want ddpfull; then
  gpu_step "bench ddp --device cuda --focus (suite)" 60 400 python3 "$here/scripts/bench/ddp" \
    --focus --device cuda
  gpu_step "bench ddp --device cuda" 60 540 python3 "$here/scripts/bench/ddp" --device cuda
fi
if want grufull; then
  gpu_step "bench gru --cuda --quick --dtype bfloat16" 30 120 python3 "$here/scripts/bench/gru" --cuda --quick --dtype bfloat16
  gpu_step "bench gru --cuda" 60 420 python3 "$here/scripts/bench/gru" --cuda
fi
python3 "$here/scripts/device/summarize.py" "$out" "$steps"
rc=$?
pack_results
exit $rc
