"""The network misbehaves: two ranks of ddpx-train on a lossy link (a network
namespace of our own, its loopback impaired; lossy_link.py), over ddpx_mpi
(mpirun, MPI over TCP) and over Gloo (torchrun).

- 1% packet loss with jitter and reordering (netem where the kernel has
  it, else nftables + an htb slow lane: lossy_link.py): GradSync training
  completes, and its parameters are bit for bit those of the same run on a
  clean link (two ranks: each element's sum is one addition, whatever the
  bucket plan the timing led to). The namespace's TCP counters show the
  link really reordered (out-of-order segments) and lost (retransmits).
- The link cut mid-run (100% loss): every rank exits non-zero within
  DDPX_TIMEOUT_S + MARGIN s with a timeout error that names the collective
  (under Gloo also GradSync's step and Gloo's transfer), and the last
  checkpoint is whole and resumes on the healed link.

Skipped with a message where namespaces cannot be made (root / CAP_NET_ADMIN)
or the kernel can drop no packets (neither netem nor nftables)."""
import sys
import time

import pytest
import torch

from lossy_link import LossyLink
from trainer_util import MPIRUN, TRAIN, checkpoint_tensors, env, free_port, kill_group, model, run, start, wait_for

T = 8        # DDPX_TIMEOUT_S of the cut runs
MARGIN = 30  # the job's end after the timeout: the error, the roll call, the abort


def command(launcher, *args):
    args = [str(a) for a in args]
    if launcher == "mpirun":
        # MPI over TCP on the namespace's loopback (no shared memory: it would bypass the link).
        return MPIRUN + ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo",
                         "--mca", "oob_tcp_if_include", "lo", "-np", "2", TRAIN, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), "--no-python", TRAIN, *args]


def train_args(tmp_path, data, tag, *extra):
    return ["--model", model("lenet"), "--data-cache", data, "--batch-size", 16, "--log-every", 20,
            "--seed", 3, "--checkpoint", tmp_path / f"{tag}.ckpt", *extra]


def net_env(**extra):
    return env(GLOO_SOCKET_IFNAME="lo", **extra)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


@pytest.mark.parametrize("launcher", ["mpirun", "torchrun"])
def test_lossy_link_trains_bitwise_as_a_clean_one(tmp_path, data, launcher):
    steps = 60
    with LossyLink() as link:
        results = {}
        for tag in ("clean", "lossy"):
            if tag == "lossy":
                link.impair()
            t0 = time.monotonic()
            before = link.tcp_counters()
            r = run(link.prefix + command(launcher, *train_args(tmp_path, data, tag, "--steps", steps)),
                    env=net_env(DDPX_TIMEOUT_S=120), timeout=900)
            assert r.returncode == 0, f"{link.impairment}:\n{r.stdout}\n{r.stderr}"
            after = link.tcp_counters()
            seen = {k: after.get(k, 0) - before.get(k, 0) for k in ("TCPOFOQueue", "RetransSegs")}
            print(f"{launcher} {steps} steps on the {link.impairment} link: {time.monotonic() - t0:.1f} s, "
                  f"TCP: {seen}")
            if tag == "lossy":
                assert seen["TCPOFOQueue"] > 0 and seen["RetransSegs"] > 0, f"the link behaved: {seen}"
            results[tag] = checkpoint_tensors(tmp_path / f"{tag}.ckpt")
    (clean, clean_pos), (lossy, lossy_pos) = results["clean"], results["lossy"]
    assert clean_pos == lossy_pos and clean_pos[0] == steps
    assert clean.keys() == lossy.keys()
    for name in clean:
        assert torch.equal(clean[name], lossy[name]), f"{name} differs after the lossy run"


@pytest.mark.parametrize("launcher", ["mpirun", "torchrun"])
def test_cut_link_ends_every_rank_and_the_checkpoint_resumes(tmp_path, data, launcher):
    args = train_args(tmp_path, data, "cut", "--checkpoint-every", 10)
    with LossyLink() as link:
        p = start(link.prefix + command(launcher, *args, "--steps", 1000000), env=net_env(DDPX_TIMEOUT_S=T))
        lines = []

        def training():  # two checkpoints written: the cut comes mid-run
            line = p.stdout.readline()
            lines.append(line)
            return "step 20/" in line or (line == "" and p.poll() is not None)

        try:
            wait_for(training, 300, "training to start")
            assert p.poll() is None, "".join(lines)
            link.cut()
            t0 = time.monotonic()
            out, _ = p.communicate(timeout=T + MARGIN + 60)
            elapsed = time.monotonic() - t0
        finally:
            kill_group(p)
        out = "".join(lines) + out
        print(f"{launcher}: link cut; the job ended after {elapsed:.1f} s (DDPX_TIMEOUT_S={T}), "
              f"exit code {p.returncode}")
        assert p.returncode != 0, out
        assert elapsed <= T + MARGIN, f"{elapsed:.1f} s > {T} + {MARGIN} s\n{out}"
        assert "timed out" in out.lower() or "timeout" in out.lower(), out
        assert "waiting for allreduce" in out.lower(), out  # the collective, over either backend
        if launcher == "torchrun":  # Gloo names its transfer; GradSync adds the step
            assert "GradSync: step" in out and "recv operation" in out, out

        # The last checkpoint is whole (the write is atomic) and resumes.
        tensors, (step, _, _) = checkpoint_tensors(tmp_path / "cut.ckpt")
        assert step >= 10 and step % 10 == 0 and tensors
        link.heal()
        r = run(link.prefix + command(launcher, *args, "--resume", "--steps", step + 10),
                env=net_env(DDPX_TIMEOUT_S=120), timeout=900)
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
        assert checkpoint_tensors(tmp_path / "cut.ckpt")[1][0] == step + 10
