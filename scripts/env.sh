# Source me: puts the ddpx venv's python, the built library (DDPX_LIB) and the
# project's executables on this shell's PATH.   source scripts/env.sh
_ddpx_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$_ddpx_root/scripts/versions.sh"
export DDPX_ROOT=$_ddpx_root
export DDPX_VENV
export DDPX_BUILD="$DDPX_ROOT/$DDPX_BUILD_DIR"
export DDPX_LIB="$DDPX_BUILD/libddpx.so"
export PATH="$DDPX_BUILD:$DDPX_VENV/bin:$PATH"
# Run as root inside containers: OpenMPI refuses that unless told.
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
unset _ddpx_root
