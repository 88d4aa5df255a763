"""Finding and loading libddpx.so, once per process.

An installed package (``pip install .``) carries its library in ``ddpx/lib``
and a ``_build_info`` module written by CMake (the torch it was compiled
against). A source tree (``PYTHONPATH=plugin/python``, as the tests run before
installing) has neither and loads ``$DDPX_LIB`` (``source scripts/env.sh``).
"""
import os
from pathlib import Path
from typing import Optional

import torch

_HERE = Path(__file__).resolve().parent
_INSTALLED_LIB = _HERE / "lib" / "libddpx.so"

try:
    from . import _build_info  # type: ignore[attr-defined]
except ImportError:  # a source tree
    _build_info = None


def version() -> str:
    return _build_info.VERSION if _build_info else "0+source"


def built_against() -> Optional[str]:
    """The torch version the library was compiled against (None: unknown)."""
    return _build_info.TORCH_VERSION if _build_info else None


def _minor(v: str):
    parts = v.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def check_torch_version(built: Optional[str], running: str) -> None:
    """A C++ extension runs only on the torch minor release it was compiled
    against (LibTorch's ABI changes between them): refuse another one with
    what to do, rather than fail later with an undefined symbol."""
    if built is None or _minor(built) == _minor(running):
        return
    raise ImportError(
        f"ddpx was built against torch {built} but this Python runs torch {running}: "
        f"rebuild it in this environment (pip install --no-cache-dir --force-reinstall "
        f"<ddpx checkout>), or install torch {built}")


def _already_loaded() -> Optional[str]:
    for path in getattr(torch.ops, "loaded_libraries", ()):
        if os.path.basename(path) == "libddpx.so":
            return path
    return None


def load() -> str:
    """Loads the library (ops, ddpx_mpi, codecs) unless this process already
    has a libddpx.so; returns its path. Two copies would register every op
    twice, so a second one is never loaded."""
    loaded = _already_loaded()
    if loaded:
        return loaded
    if _INSTALLED_LIB.exists():
        path = str(_INSTALLED_LIB)
    else:
        path = os.environ.get("DDPX_LIB", "")
        if not path or not os.path.exists(path):
            raise ImportError(
                "ddpx: libddpx.so not found: install the package (pip install . in the ddpx "
                "checkout) or, in a source tree, set DDPX_LIB (source scripts/env.sh)"
                + (f"; DDPX_LIB={path} does not exist" if path else ""))
    torch.ops.load_library(path)
    return path


def cmake_prefix_path() -> str:
    return str(_HERE) if (_HERE / "lib" / "cmake" / "ddpx").is_dir() else ""
