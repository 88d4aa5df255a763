"""Two ranks as two hosts: two network namespaces joined by a veth pair, with
addresses the test picks, launched by torchrun's multi-node form. Nothing may
assume one host: not shared memory, not 127.0.0.1. Skipped with a message
where namespaces cannot be made (needs root / CAP_NET_ADMIN)."""
import os
import random
import subprocess

import pytest

from trainer_util import env, model, read_metrics, start, kill_group, TRAIN

import sys


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


def test_two_hosts_over_veth(tmp_path, two_hosts):
    ns, veth, addrs = two_hosts
    port = random.randint(20000, 40000)
    procs = []
    for node in (0, 1):
        cmd = ["ip", "netns", "exec", ns[node], sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
               "--master-addr", addrs[0], "--master-port", str(port), "--no-python", TRAIN,
               "--model", model("mlp"), "--steps", "40", "--batch-size", "32", "--log-every",
               "20", "--data-cache", str(tmp_path / f"data{node}"),  # each host its own files
               "--metrics", str(tmp_path / f"m{node}.jsonl"),
               "--checkpoint", str(tmp_path / f"host{node}" / "run.ckpt")]
        (tmp_path / f"host{node}").mkdir()
        procs.append(start(cmd, env=env(GLOO_SOCKET_IFNAME=veth[node], DDPX_TIMEOUT_S=60)))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            kill_group(p)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    assert "2 rank(s) over gloo" in outs[0]
    assert read_metrics(tmp_path / "m0.jsonl")[-1]["event"] == "end"
    # Only rank 0 writes checkpoints, on its own host.
    assert (tmp_path / "host0" / "run.ckpt").exists()
    assert not (tmp_path / "host1" / "run.ckpt").exists()
