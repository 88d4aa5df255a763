"""One flight-recorder scenario (test_flight_recorder.py runs it under
mpirun): the ranks all-reduce a few times, and one goes wrong at the fourth
call as the scenario says. Dumps go to TORCH_FR_DUMP_TEMP_FILE<rank>.

  skip     the last rank skips the fourth all-reduce, then goes quiet: the
           others time out (and dump); rank 0 asks the quiet one for its
           buffer with SIGUSR1, as an operator would
  op       rank 1 broadcasts where the others all-reduce
  size     the last rank all-reduces 9 elements where the others send 8
  healthy  40 all-reduces, then every rank dumps (ddpx.distributed.dump_trace)
"""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import ddpx

scenario = sys.argv[1]
dist.init_process_group("ddpx_mpi")
r, n = dist.get_rank(), dist.get_world_size()
prefix = os.environ["TORCH_FR_DUMP_TEMP_FILE"]
late = n - 1
pid_file = os.path.join(os.path.dirname(prefix), "quiet.pid")  # not a dump's name


def wait_for(path, seconds=30):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


try:
    for i in range(40 if scenario == "healthy" else 6):
        wrong = i == 3 and ((scenario in ("skip", "size") and r == late) or
                            (scenario == "op" and r == 1))
        if wrong and scenario == "skip":
            continue
        t = torch.ones(9 if wrong and scenario == "size" else 8)
        if wrong and scenario == "op":
            dist.broadcast(t, 0)
        else:
            dist.all_reduce(t)
    if scenario == "skip" and r == late:
        ddpx.distributed.dump_trace_on_signal()
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        time.sleep(120)  # quiet until the job is ended
    if scenario == "healthy":
        dist.barrier()
        print("DUMPED", ddpx.distributed.dump_trace(), flush=True)
    print(f"RESULT {r} ok", flush=True)
except Exception as e:  # noqa: BLE001 (what the scenario provokes)
    print(f"RESULT {r} error {str(e).splitlines()[0]}", flush=True)
    if scenario == "skip":
        if r == 0:
            wait_for(pid_file)
            with open(pid_file) as f:
                os.kill(int(f.read()), signal.SIGUSR1)
        # Stay until the quiet rank has written its buffer: leaving ends the job.
        wait_for(prefix + str(late))
        time.sleep(0.5)
