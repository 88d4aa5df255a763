#!/usr/bin/env bash
# scripts/fuzz.sh TARGET SECONDS [libFuzzer args...]   fuzz one parser
# scripts/fuzz.sh --list                               the targets
# scripts/fuzz.sh --write-seeds TARGET                 refresh a binary target's seeds
#
# Targets (tests/fuzz/fuzz_<target>.cpp): checkpoint, idx, data_file,
# codec_spec, trace_steps, member_id, ps_wire. Built in build-asan (clang,
# ASan + UBSan). The corpus grows in build-asan/tests/fuzz/corpus/<target>,
# starting from tests/fuzz/corpus/<target> and tests/fuzz/regressions/<target>;
# a crash leaves its input in build-asan/tests/fuzz/crashes/ -- add it to
# regressions/<target>/ with the fix.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
targets=(checkpoint idx data_file codec_spec trace_steps member_id ps_wire)
usage() { echo "usage: $0 TARGET SECONDS [libFuzzer args] | --list | --write-seeds TARGET" >&2; exit 2; }
[ $# -ge 1 ] || usage
if [ "$1" = --list ]; then printf '%s\n' "${targets[@]}"; exit 0; fi
seeds=""
if [ "$1" = --write-seeds ]; then seeds=1; shift; fi
target=${1:-}; [ -n "$target" ] || usage
[[ " ${targets[*]} " == *" $target "* ]] || { echo "unknown target '$target'; one of: ${targets[*]}" >&2; exit 2; }
source "$here/scripts/instrumented_tree.sh"
ddpx_instrumented_tree address
cmake --build "$DDPX_ITREE" -j "${DDPX_JOBS:-$(nproc)}" --target "fuzz_$target"
exe="$DDPX_ITREE/tests/fuzz/fuzz_$target"
# The tree's sanitizer options (halt on the first report, leak check on).
source "$DDPX_ITREE/sanitizer_env.sh"
if [ -n "$seeds" ]; then
  DDPX_FUZZ_WRITE_SEEDS="$here/tests/fuzz/corpus/$target" "$exe"
  ls -l "$here/tests/fuzz/corpus/$target"
  exit 0
fi
seconds=${2:-}; [ -n "$seconds" ] || usage
shift 2
work="$DDPX_ITREE/tests/fuzz/corpus/$target"
crashes="$DDPX_ITREE/tests/fuzz/crashes/$target"
mkdir -p "$work" "$crashes"
dirs=("$here/tests/fuzz/corpus/$target")
[ -d "$here/tests/fuzz/regressions/$target" ] && dirs+=("$here/tests/fuzz/regressions/$target")
args=()
[ -f "$here/tests/fuzz/$target.args" ] && mapfile -t args < <(grep '^-' "$here/tests/fuzz/$target.args")
exec "$exe" "$work" "${dirs[@]}" -max_total_time="$seconds" "${args[@]}" \
  -artifact_prefix="$crashes/" -print_final_stats=1 "$@"
