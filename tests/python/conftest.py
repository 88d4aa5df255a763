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


# scripts/device/check.sh sets DDPX_REQUIRE_GPU=1: there a CUDA test runs and
# passes or fails, never skips (a check that "passes" by skipping proves nothing).
REQUIRE_GPU = os.environ.get("DDPX_REQUIRE_GPU") == "1"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() and not REQUIRE_GPU,
                                reason="no CUDA GPU on this machine: CUDA tests skipped")


def pytest_configure(config):
    config.addinivalue_line("markers", "sanitizer: the few cases scripts/device/check.sh runs "
                            "under compute-sanitizer (every launch instrumented: slow)")
    config.addinivalue_line("markers", "auto_path: runs with the op's own path rule (the CUDA "
                            "tests otherwise force our kernels with DDPX_CONV_PATH=tiled)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_GPU and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped under DDPX_REQUIRE_GPU=1: {report.longrepr}"
