# Pinned versions: one place, sourced by setup.sh and env.sh.
# The virtual environment lives outside the checkout and is keyed by these
# pins, so every clone on a machine reuses it.
DDPX_TORCH_VERSION=${DDPX_TORCH_VERSION:-2.15.0}        # PyPI's default wheel: CUDA 13 (cu13 NCCL/cuDNN)
DDPX_PY_PACKAGES="numpy==2.4.6 pytest==9.2.0 matplotlib==3.11.2 expecttest==0.3.0"
DDPX_PYTHON=${DDPX_PYTHON:-python3}
_pyver=$("$DDPX_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
DDPX_VENV=${DDPX_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ddpx/venv-torch${DDPX_TORCH_VERSION}-py${_pyver}}
DDPX_BUILD_DIR=${DDPX_BUILD_DIR:-build}
