#!/usr/bin/env bash
# Run here (Debian 12, package registries reachable), before a session that
# has the lent GPU machine: gathers what its image lacks into one git-ignored
# folder, device_deps/, that the device call carries (`carry: ["device_deps"]`)
# and scripts/device/check.sh unpacks there.
#   - Debian's Open MPI with the libraries it loads, GoogleTest, Gloo's
#     headers, CLI11 and nlohmann-json (the .debs, not installed here);
#   - the alternatives links those packages' install scripts would make
#     (mpirun -> mpirun.openmpi, ...), read off this machine;
#   - the wheels of the Python packages the tests import that the image lacks.
# The list is what ../shared/GPU.md measured: a bare glibc system with just
# these ran `mpirun -np 2` of an MPI program. check.sh never replaces a file
# the image already has, so listing a library the image carries costs only
# its bytes here.
#   scripts/device/prepare.sh [DIR]     (default: device_deps)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${1:-$here/device_deps}
debs=(openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev libpmix2 libmunge2 libhwloc15
      libevent-core-2.1-7 libevent-pthreads-2.1-7 libfabric1 libucx0 libibverbs1
      ibverbs-providers librdmacm1 libnl-3-200 libnl-route-3-200 libpsm2-2
      libpsm-infinipath1 libnuma1 libudev1 libatomic1 zlib1g libuuid1
      libgtest-dev libgloo-dev libcli11-dev nlohmann-json3-dev)
# Pure-Python packages our tests import that the image (KINDS.md's list) lacks.
wheels=(expecttest==0.3.0)
alternatives=(mpi mpirun mpi-x86_64-linux-gnu libpsm_infinipath.so.1)

rm -rf "$out"
mkdir -p "$out/debs" "$out/wheels"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
$SUDO apt-get update -qq
# apt-get download writes into the current directory (as the _apt user when
# it can: the folder must be writable by it).
chmod 0777 "$out/debs"
(cd "$out/debs" && apt-get download -qq "${debs[@]}")

# "LINK TARGET" per line: each alternative's master and slave links and what
# /etc/alternatives points them at here (man pages left out).
for name in "${alternatives[@]}"; do
  update-alternatives --query "$name" | awk '
    /^Link: / { print $2 }
    /^Slaves:/ { s = 1; next }
    /^Status:/ { s = 0 }
    s && NF == 2 { print $2 }' | while read -r link; do
      case "$link" in *.gz) continue ;; esac
      case "$(readlink "$link")" in
        /etc/alternatives/*) echo "$link $(readlink "$(readlink "$link")")" ;;
      esac
    done
done >"$out/links.txt"

python3 -m pip download -q --no-deps --only-binary=:all: -d "$out/wheels" "${wheels[@]}"

echo "[prepare] $(ls "$out/debs" | wc -l) packages, $(wc -l <"$out/links.txt") links," \
     "$(ls "$out/wheels" | wc -l) wheels: $(du -sh "$out" | cut -f1) in $out"
