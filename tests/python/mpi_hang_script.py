"""Run by test_mpi_wait_timeout.py under its own mpirun: rank 0 waits for a
collective that the other ranks never join (they sleep, as a stopped rank
would). The wait must end with ddpx_mpi's timeout error naming the
collective, not hang. Rank 0 prints "RESULT <outcome> <seconds> <message>"."""
import os
import sys
import time

import torch
import torch.distributed as dist

torch.ops.load_library(os.environ["DDPX_LIB"])
kind = sys.argv[1]
dist.init_process_group(backend="ddpx_mpi")
t = torch.ones(8)
dist.all_reduce(t)  # everyone is alive here
if dist.get_rank() != 0:
    if kind == "callback":
        dist.all_reduce(torch.ones(2))  # the collective whose callback waits
    time.sleep(120)
    sys.exit(0)


def cb(fut):
    # Issued inside a callback: a broadcast the peers never join.
    x = torch.ones(3)
    dist.broadcast(x, src=1, async_op=True).get_future().wait()
    return x


t0 = time.monotonic()
try:
    if kind == "future":
        # Future.wait has no timeout of its own.
        dist.all_reduce(t, async_op=True).get_future().wait()
    elif kind == "callback":
        dist.all_reduce(torch.ones(2), async_op=True).get_future().then(cb).wait()
    else:
        raise SystemExit(f"unknown kind {kind}")
    print(f"RESULT completed {time.monotonic() - t0:.1f} -", flush=True)
except Exception as e:  # noqa: BLE001
    msg = str(e).replace("\n", " ")
    print(f"RESULT error {time.monotonic() - t0:.1f} {msg}", flush=True)
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    if hasattr(backend, "get_error"):  # (torch 2.15; 2.11 has none)
        print(f"ERROR_TYPE {backend.get_error()}", flush=True)
sys.exit(3)
