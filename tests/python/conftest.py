"""Shared pytest set-up: every test loads the plugin the way a user does."""
import os

import pytest
import torch


def _lib_path():
    path = os.environ.get("DDPX_LIB")
    if not path:
        pytest.exit("DDPX_LIB is not set: run the tests through ctest or source scripts/env.sh",
                    returncode=2)
    return path


torch.ops.load_library(_lib_path())
