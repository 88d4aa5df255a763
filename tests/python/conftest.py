"""Shared pytest set-up: every test loads the plugin the way a user does."""
import os
import random
import subprocess

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


# Two hosts for the multi-node tests (test_trainer_hosts, test_trainer_elastic_hosts):
def sh(*cmd, check=True):
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


@pytest.fixture
def two_hosts():
    tag = f"{os.getpid() % 100000}"
    ns = [f"ddpxh{tag}a", f"ddpxh{tag}b"]
    veth = [f"dvx{tag}a", f"dvx{tag}b"]
    net = f"10.{random.randint(64, 250)}.{random.randint(1, 250)}"
    addrs = [f"{net}.1", f"{net}.2"]
    try:
        for n in ns:
            sh("ip", "netns", "add", n)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        for n in ns:
            sh("ip", "netns", "del", n, check=False)
        pytest.skip(f"cannot create network namespaces here: {getattr(e, 'stderr', e)}")
    try:
        sh("ip", "link", "add", veth[0], "netns", ns[0], "type", "veth", "peer", "name", veth[1],
           "netns", ns[1])
        for n, v, a in zip(ns, veth, addrs):
            sh("ip", "-n", n, "link", "set", "lo", "up")
            sh("ip", "-n", n, "addr", "add", f"{a}/24", "dev", v)
            sh("ip", "-n", n, "link", "set", v, "up")
        yield ns, veth, addrs
    finally:
        for n in ns:
            sh("ip", "netns", "del", n, check=False)


# The generated datasets of the trainer tests, written once per test module
# (each module's runs share them).
@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def mpi_and_gloo():
    """torch.distributed over the ddpx_mpi world (under mpirun), and a Gloo
    group beside it: {"ddpx_mpi": None (the default group), "gloo": group}."""
    import torch.distributed as dist
    dist.init_process_group(backend="ddpx_mpi")
    yield {"ddpx_mpi": None, "gloo": dist.new_group(backend="gloo")}
    dist.destroy_process_group()


@pytest.fixture(params=["ddpx_mpi", "gloo"])
def group(request, mpi_and_gloo):
    """Each test once over ddpx_mpi's default group and once over Gloo."""
    return mpi_and_gloo[request.param]
