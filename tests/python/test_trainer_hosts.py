"""Two ranks as two hosts: two network namespaces joined by a veth pair, with
addresses the test picks (conftest.py's two_hosts), launched by torchrun's
multi-node form. Nothing may assume one host: not shared memory, not
127.0.0.1. Skipped with a message where namespaces cannot be made (needs
root / CAP_NET_ADMIN)."""
import random

from trainer_util import env, model, read_metrics, start, kill_group, TRAIN

import sys


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
