"""ddpx: data-parallel training for PyTorch -- the Python face of libddpx.so.

``import ddpx`` loads the library once. That registers

* the ops ``torch.ops.ddpx.*`` (``ddpx.ops`` wraps them with keyword
  arguments), and the modules of ``ddpx.nn`` built on them;
* the ``ddpx_mpi`` c10d backend: ``torch.distributed.init_process_group("ddpx_mpi")``
  works right after the import (under ``mpirun``: rank, size and the store
  come from MPI);
* the codecs behind ``ddpx.distributed``'s DDP comm hooks.

For C++ consumers: ``ddpx.library_path()`` and ``ddpx.cmake_prefix_path``
(``find_package(ddpx)`` with ``CMAKE_PREFIX_PATH`` set to it), as
``torch.utils.cmake_prefix_path`` does for torch.

Where torch's backend autoload is on (``TORCH_DEVICE_BACKEND_AUTOLOAD``,
default 1), an installed ddpx is loaded by ``import torch`` itself through
the ``torch.backends`` entry point, so ``init_process_group("ddpx_mpi")``
works with no import at all.
"""
def _autoload() -> None:
    """The ``torch.backends`` entry point, called at the end of ``import
    torch``: importing this module did the work. Defined before this module
    imports torch, since ``import ddpx`` before torch makes torch's autoload
    call it on this module while it is still being imported (the library is
    then loaded when the import goes on)."""


import torch  # noqa: E402

from . import _loader  # noqa: E402

__all__ = ["library_path", "cmake_prefix_path", "__version__", "ops", "nn", "distributed"]

__version__ = _loader.version()

_loader.check_torch_version(_loader.built_against(), torch.__version__)
_LIBRARY = _loader.load()

#: The prefix under which ``find_package(ddpx)`` finds ddpxConfig.cmake; ""
#: in a source tree (there, use the build directory).
cmake_prefix_path = _loader.cmake_prefix_path()


def library_path() -> str:
    """The path of the loaded libddpx.so (to link against or to hand to
    ``torch::jit::load``'s process as ``dlopen``'s argument)."""
    return _LIBRARY


from . import distributed, nn, ops  # noqa: E402  (they need the ops loaded)
