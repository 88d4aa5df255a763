#!/usr/bin/env python3
"""One rank of PyTorch's own distributed test suite (`_DistTestBase`).

Started by scripts/torch_suite/run.py under `mpirun -np N`, as upstream runs
its MPI backend: every rank runs the same tests in the same order in one
process, on a process group made once (not one spawned process group per
test, as upstream's Gloo/NCCL runner does), so ddpx_mpi and Gloo are tried
under the very same launch.

Each rank appends one JSON line per event to its log (flushed at once, so the
driver can tell which test a crashed or hung job was in):
  {"event": "start", "test": NAME}
  {"event": "end", "test": NAME, "outcome": "pass"|"fail"|"skip", "detail": ...}
"""
import argparse
import functools
import json
import os
import sys
import time
import traceback
import unittest
from datetime import timedelta


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", required=True, help="ddpx_mpi or gloo")
    p.add_argument("--tests", required=True, help="file: one test name a line, run in that order")
    p.add_argument("--log", required=True, help="log path; {rank} is replaced by the rank")
    p.add_argument("--lib", default=os.environ.get("DDPX_LIB"), help="libddpx.so (ddpx_mpi)")
    p.add_argument("--timeout-s", type=float, default=120, help="process group timeout")
    p.add_argument("--gates", default=None,
                   help="decide the suite's backend-name checks as for this backend (gloo), "
                        "while every group the tests make is --backend's")
    return p.parse_args()


def route_groups(dist, to):
    """Every process group the tests ask Gloo for is made with `to` instead
    (the suite then runs its Gloo-only tests on our backend)."""
    import torch.distributed.distributed_c10d as c10d

    def swap(b):
        return to if b is not None and str(b).lower() == "gloo" else b

    for name in ("new_group", "init_process_group", "new_subgroups",
                 "new_subgroups_by_enumeration"):
        orig = getattr(c10d, name)

        def wrapped(*a, _orig=orig, **kw):
            if "backend" in kw:
                kw["backend"] = swap(kw["backend"])
            return _orig(*a, **kw)

        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)


def mpi_rank_and_size():
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK"))
    size = os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE"))
    if rank is None or size is None:
        sys.exit("rank.py: start me under mpirun (scripts/torch_suite.sh does)")
    return int(rank), int(size)


def main():
    args = parse_args()
    rank, world = mpi_rank_and_size()
    # distributed_test reads these at import time.
    os.environ["BACKEND"] = args.gates or args.backend
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["INIT_METHOD"] = "env://"
    os.environ["RANK"] = str(rank)
    os.environ["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"  # the error, not how to rerun it

    import torch
    import torch.distributed as dist

    if args.backend == "ddpx_mpi":
        torch.ops.load_library(args.lib)
    if args.gates:
        route_groups(dist, args.backend)
    from torch.testing._internal import common_distributed as cd

    # What ddpx_mpi implements on CPU, told to the suite the way upstream tells
    # it per backend: everything Gloo is listed for except devices (no GPU
    # path is claimed here, so GPU tests skip for both alike).
    if args.backend == "ddpx_mpi":
        for feature in ("ddp", "subgroup", "plugin"):
            cd.DistTestCases.backend_feature[feature].add("ddpx_mpi")
    from torch.testing._internal.distributed import distributed_test as dt

    skip_codes = {s.exit_code: s.message for s in cd.TEST_SKIPS.values()}
    timeout = timedelta(seconds=args.timeout_s)

    def ensure_group():
        # Some tests destroy the default group and make their own.
        if not dist.is_initialized():
            dist.init_process_group(backend=args.backend, init_method="env://", rank=rank,
                                    world_size=world, timeout=timeout)

    from torch.testing._internal.common_utils import TestCase

    class Suite(TestCase, dt.DistributedTest._DistTestBase):
        # The attributes TestDistBackend gives its spawned ranks.
        def __init__(self, name):
            super().__init__(name)
            self.rank = rank
            self.file_name = os.path.join(os.environ["TEMP_DIR"], "init_dir", "shared_init_file")

        @property
        def world_size(self):
            return world

        @property
        def init_method(self):
            return os.environ["INIT_METHOD"]

    def run_one(name):
        """Runs one test; a skip decorator's sys.exit(code) becomes a skip."""
        test = Suite(name)
        method = getattr(test, name)

        @functools.wraps(method)  # keeps unittest's skip marks
        def guarded():
            try:
                method()
            except SystemExit as e:
                if e.code in skip_codes:
                    raise unittest.SkipTest(skip_codes[e.code])
                raise AssertionError(f"the test called sys.exit({e.code})")

        setattr(test, name, guarded)
        result = unittest.TestResult()
        test.run(result)
        if result.errors or result.failures:
            tb = (result.errors or result.failures)[0][1].strip().splitlines()
            return "fail", " | ".join(tb[-3:])[:800]
        if result.skipped:
            return "skip", str(result.skipped[0][1])[:300]
        return "pass", ""

    with open(args.tests) as f:
        names = [line.strip() for line in f if line.strip()]

    ensure_group()
    log = open(args.log.replace("{rank}", str(rank)), "a", buffering=1)

    def emit(**kv):
        log.write(json.dumps(kv) + "\n")
        log.flush()
        os.fsync(log.fileno())

    sync_dir = os.path.join(os.environ["TEMP_DIR"], "suite_sync")
    os.makedirs(sync_dir, exist_ok=True)

    def line_up(step, broken=False):
        """Waits until every rank reached `step`, on files: it needs no process
        group, so a test that broke the group cannot stall it. True when any
        rank says the backend is broken."""
        path = os.path.join(sync_dir, f"{step}.{rank}")
        with open(path + ".tmp", "w") as f:
            f.write("1" if broken else "0")
        os.rename(path + ".tmp", path)
        deadline = time.monotonic() + args.timeout_s
        paths = [os.path.join(sync_dir, f"{step}.{r}") for r in range(world)]
        while not all(os.path.exists(p) for p in paths):
            if time.monotonic() > deadline:
                sys.exit(f"rank {rank}: the other ranks did not reach step {step}")
            time.sleep(0.01)
        return any(open(p).read() == "1" for p in paths)

    # A ddpx_mpi timeout ends the MPI job by design (no collective can be
    # trusted after it): a test that timed out on purpose ends this job, and
    # the driver starts a new one after it.
    broken_marks = ("the MPI job cannot continue", " timed out after ", "abandoning a collective")

    def backend_failed():
        """A test that passed by expecting a timeout (test_barrier_timeout_*)
        leaves no mark in its outcome: ask the backend (Backend.get_error)."""
        if not dist.is_initialized():
            return False
        try:
            b = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
            return b.get_error() != torch._C._distributed_c10d.ErrorType.SUCCESS
        except Exception:  # noqa: BLE001 (a group the test tore down)
            return False

    broken = False
    for i, name in enumerate(names):
        if line_up(i, broken):
            os._exit(3)  # MPI cannot finalise with a collective stuck in it
        # The suite's own file barrier counts calls; a test that failed on one
        # rank part-way leaves the counts apart. A common base per test lines
        # them up again (the barrier compares with >=).
        dt.Barrier.barrier_id = 100000 * (i + 1)
        emit(event="start", test=name)
        t0 = time.monotonic()
        try:
            ensure_group()
            outcome, detail = run_one(name)
        except Exception:  # the harness itself (re-initialising the group)
            outcome, detail = "fail", traceback.format_exc().strip().splitlines()[-1][:500]
        emit(event="end", test=name, outcome=outcome, detail=detail,
             seconds=round(time.monotonic() - t0, 3))
        broken = args.backend == "ddpx_mpi" and (any(m in detail for m in broken_marks)
                                                 or backend_failed())
    line_up(len(names))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
