"""Run by test_mpi_exit.py under its own mpirun: leaves ddpx_mpi Works whose
tensors only C++ still holds (temporaries handed to collectives, Futures
with callbacks that return fresh tensors, functional collectives) and exits
at once, without destroy_process_group when told. Such a tensor's Python
object needs the GIL to be freed; if a ddpx thread frees it while Python
finalises, the process dies with "terminate called without an active
exception" (issue 22). Every rank prints "EXIT-READY <rank>" last."""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

torch.ops.load_library(os.environ["DDPX_LIB"])
destroy = sys.argv[1] == "destroy"
dist.init_process_group(backend="ddpx_mpi")
futs = []
for i in range(int(sys.argv[2])):
    # Temporaries: once the call returns only the Work holds them.
    w = dist.all_reduce(torch.full((64,), float(i)), async_op=True)
    futs.append(w.get_future().then(lambda f: [t * 2 for t in f.value()]))
    dist.all_gather_into_tensor(torch.empty(64 * dist.get_world_size()), torch.ones(64),
                                async_op=True)
    funcol.all_reduce(torch.ones(32), "sum", dist.group.WORLD)
futs[-1].wait()  # the rest complete on their own, during exit or not
print(f"EXIT-READY {dist.get_rank()}", flush=True)
if destroy:
    dist.destroy_process_group()
