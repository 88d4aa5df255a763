"""Issue 46, part 2 on two hosts (conftest.py's two_hosts: two network
namespaces over a veth pair): torchrun's elastic form (c10d rendezvous,
--nnodes 1:2, --max-restarts) runs ddpx-train on both; one host is killed
mid-run (its agent and its worker, kill -9). The survivor's worker fails in
its next collective, torchrun restarts it at the world size that is left
(1), and ddpx-train resumes by itself from the newest checkpoint (a file
system both hosts see; only rank 0 writes) and finishes the epoch.

Checked:
- the final parameters equal a run that changed world size at the same
  step by hand (2 ranks to the checkpoint's step, then 1 rank --resume) up
  to float32 summation order (bound 1e-6, as test_trainer_elastic);
- every training sample of the epoch is used exactly once by the steps
  that made the final model (DDPX_TRAIN_SAMPLE_LOG: the first start's steps
  before the checkpoint, the restart's from it), and the restart's first
  global batches are those the first start took after the checkpoint.
"""
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

from trainer_util import (TRAIN, checkpoint_params, env, kill_group, model, mpirun_cmd, run,
                          start, wait_for)

SAMPLES, GLOBAL = 600, 12  # one epoch: 50 steps
COMMON = ["--model", model("han"), "--train-samples", SAMPLES, "--global-batch", GLOBAL,
          "--steps", SAMPLES // GLOBAL, "--seed", 5, "--lr", 0.05, "--lr-schedule", "constant",
          "--log-every", 5, "--checkpoint-every", 5]
# (SGD: Adam's normalisation blew float32 summation differences of rarely
# seen embedding rows up to 8e-5 in 35 steps.)


def read_log(base):
    """{restart: {step: {rank: samples}}} from every file of DDPX_TRAIN_SAMPLE_LOG."""
    out = {}
    for f in base.parent.glob(base.name + ".*.*"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            out.setdefault(r["restart"], {}).setdefault(r["step"], {})[r["rank"]] = r["samples"]
    return out


def workers(marker, env_item=""):
    """Pids of the ddpx-train processes of this test (their command line
    holds `marker`) whose environment holds env_item. torchrun starts its
    workers in sessions of their own: killing an agent's group spares them."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            if not cmd[0].endswith(b"ddpx-train") or marker.encode() not in cmd:
                continue
            if env_item.encode() in (proc / "environ").read_bytes().split(b"\0") or not env_item:
                out.append(int(proc.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_lost_host_restarts_smaller_and_every_sample_counts_once(tmp_path, two_hosts):
    ns, veth, addrs = two_hosts
    port = random.randint(20000, 40000)
    ckpt, samples = tmp_path / "run.ckpt", tmp_path / "samples"
    procs = []
    for node in (0, 1):
        # Rank 0 sleeps 150 ms a step (--straggler: the numbers are
        # unchanged), so the run lasts long enough to be cut mid-way.
        cmd = ["ip", "netns", "exec", ns[node], sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"{addrs[0]}:{port}", "--rdzv-id", "ddpx-elastic",
               # Host a serves the rendezvous store (torch cannot tell: both
               # namespaces have the machine's hostname).
               "--rdzv-conf", f"last_call_timeout=10,is_host={int(node == 0)}",
               "--local-addr", addrs[node],  # else the workers' store address is "vm"
               "--max-restarts", "2",
               "--monitor-interval", "0.5", "--no-python", TRAIN, *map(str, COMMON),
               "--straggler", "0:150", "--checkpoint", str(ckpt)]
        procs.append(start(cmd, env=env(GLOO_SOCKET_IFNAME=veth[node], DDPX_TIMEOUT_S=20,
                                        DDPX_TRAIN_SAMPLE_LOG=str(samples))))
    try:
        # Kill host b once the first start is past its checkpoint of step 15.
        def past_15():
            log = read_log(samples).get(0, {})
            return len(log.get(17, {})) == 2
        try:
            wait_for(past_15, 120, "both hosts to train past step 17")
        except AssertionError:
            for p in procs:
                kill_group(p)
            raise AssertionError("\n".join(p.communicate()[0][-3000:] for p in procs))
        t_kill = time.monotonic()
        # Host b goes: its agent and its worker at once.
        kill_all(workers(str(ckpt), f"GLOO_SOCKET_IFNAME={veth[1]}"))
        kill_group(procs[1])
        out = procs[0].communicate(timeout=240)[0]
        elapsed = time.monotonic() - t_kill
    finally:
        for p in procs:
            kill_group(p)
        kill_all(workers(str(ckpt)))
    assert procs[0].returncode == 0, out
    assert "torchrun restart 1 with 1 rank(s): resuming from" in out, out
    resumed = int(out.split(f"resumed from {ckpt} at step ")[1].split()[0])
    assert resumed >= 15 and resumed % 5 == 0, out
    assert "written by 2 rank(s); going on at 1" in out, out
    print(f"the survivor finished {elapsed:.1f} s after the kill, from step {resumed}")

    # Every sample once: the first start's steps before the checkpoint, the
    # restart's after it; each step a full global batch.
    log = read_log(samples)
    steps = SAMPLES // GLOBAL
    used = []
    for step in range(steps):
        start_no = 0 if step < resumed else 1
        by_rank = log[start_no][step]
        assert len(by_rank) == (2 if start_no == 0 else 1), (step, by_rank.keys())
        batch = [i for r in sorted(by_rank) for i in by_rank[r]]
        assert len(batch) == GLOBAL, (step, batch)
        used += batch
        if start_no == 1 and step in log[0] and len(log[0][step]) == 2:
            # The very global batch the first start took at that step.
            first = sorted(i for r in log[0][step].values() for i in r)
            assert sorted(batch) == first, step
    assert sorted(used) == list(range(SAMPLES))

    # The same change of world size by hand, under mpirun.
    ref = tmp_path / "ref.ckpt"
    common = [*COMMON[:COMMON.index("--steps")], *COMMON[COMMON.index("--seed"):]]
    r = run(mpirun_cmd(2, *common, "--steps", resumed, "--checkpoint", ref))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(mpirun_cmd(1, *common, "--steps", steps, "--checkpoint", ref, "--resume"))
    assert r.returncode == 0, r.stdout + r.stderr
    (got, gstep), (want, wstep) = checkpoint_params(ckpt), checkpoint_params(ref)
    assert gstep == wstep == steps
    assert got.keys() == want.keys()
    for k in want:
        assert (got[k] - want[k]).abs().max() <= 1e-6, (k, (got[k] - want[k]).abs().max())
