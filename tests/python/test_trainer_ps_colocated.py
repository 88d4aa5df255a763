"""ddpx-train --mode ps --servers colocated (issue 45): every rank trains and
serves 1/world of the parameters on a thread of its own.

Stated targets (CPU, generated data):
- MLP, sync, colocated on 2 and 3 ranks: the logged losses equal --mode
  sync (GradSync) on as many ranks to 1e-5 relative (same shards, same
  mean: the C++ test checks the parameters bit for bit).
- LeNet, async, 2 ranks, rank 1 a 20 ms straggler, 200 steps of 32 at lr
  0.02: test accuracy >= 80%; every gradient applied on both shards.
- MLP, sync, int8 pushes: stopped after 12 of 20 steps and resumed from
  each rank's server checkpoint and worker residuals: the same losses and
  test accuracy; a resume at another world size is an error naming both.
- A rank killed with kill -9 (ddpx-run: mpirun told to let the others
  live) or frozen by SIGSTOP takes its shard with it: the other ranks fail
  within DDPX_TIMEOUT_S (5 s) + 15 s naming that server, the status file
  says failed, ddpx-run and mpirun exit non-zero.
"""
import re
import signal

import pytest

from trainer_util import (mpirun_cmd, model, ps_stop_and_resume, read_metrics, run,
                          signal_rank_mid_run)


@pytest.mark.parametrize("np", [2, 3])
def test_sync_equals_gradsync(tmp_path, data_cache, np):
    common = ["--model", model("mlp"), "--data-cache", data_cache, "--steps", 20,
              "--batch-size", 32, "--log-every", 5]
    ref, ps = tmp_path / "ref.jsonl", tmp_path / "ps.jsonl"
    r = run(mpirun_cmd(np, *common, "--metrics", ref))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(mpirun_cmd(np, "--mode", "ps", "--servers", "colocated", "--consistency", "sync",
                       *common, "--metrics", ps))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"colocated servers on every rank, {np} worker(s), consistency sync" in r.stdout
    want = [m["loss"] for m in read_metrics(ref) if "event" not in m]
    got = [m["loss"] for m in read_metrics(ps) if "event" not in m]
    assert len(got) == len(want) == 4
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    end = read_metrics(ps)[-1]
    assert end["updates"] == 20 and end["applied"] == 20 * np and end["dropped"] == 0, end


def test_lenet_async(tmp_path, data_cache):
    metrics = tmp_path / "m.jsonl"
    r = run(mpirun_cmd(2, "--mode", "ps", "--servers", "colocated", "--model", model("lenet"),
                       "--data-cache", data_cache, "--steps", 200, "--batch-size", 32,
                       "--lr", 0.02, "--log-every", 50, "--metrics", metrics,
                       "--straggler", "1:20"))
    assert r.returncode == 0, r.stdout + r.stderr
    end = read_metrics(metrics)[-1]
    assert end["event"] == "end" and end["updates"] == 400 and end["applied"] == 400, end
    assert end["workers_lost"] == 0, end
    assert end["test_accuracy"] >= 0.80, end
    assert end["staleness"]["max"] >= 1, end


def test_resume_equals_uninterrupted(tmp_path, data_cache):
    common = ["--mode", "ps", "--servers", "colocated", "--consistency", "sync", "--model",
              model("mlp"), "--codec", "int8", "--data-cache", data_cache, "--batch-size", 16,
              "--log-every", 4]

    def other_world_size_refused(ckpt, m):
        assert (tmp_path / "run.ckpt.server1").exists()
        r = run(mpirun_cmd(3, *common, "--steps", 20, "--checkpoint", ckpt, "--resume",
                           "--metrics", tmp_path / "other.jsonl"))
        assert r.returncode != 0, r.stdout
        # (Whichever rank reports first.)
        assert re.search(r"the checkpoint was written by server (\d) of 2 for 2 workers .*; "
                         r"this is server \1 of 3 with 3 workers", r.stderr), r.stderr
    ps_stop_and_resume(tmp_path, 2, common, other_world_size_refused)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "sigstop"])
def test_lost_rank_takes_its_shard_the_job_fails_in_time(tmp_path, data_cache, sig):
    out, rc, elapsed, _, status = signal_rank_mid_run(
        tmp_path, data_cache, 1000000, 1, sig, np=2, extra=["--servers", "colocated"])
    assert rc != 0, out
    assert elapsed <= 5 + 15, f"{elapsed:.1f} s\n{out}"
    assert "server 1 (rank 1) sent nothing for 5 s" in out, out
    assert status.startswith("failed: ") and "server 1 (rank 1) sent nothing" in status, status
    if sig == signal.SIGKILL:
        assert "ddpx-run: the job failed: failed: " in out, out


@pytest.mark.parametrize("args,message", [
    (["--servers", 0], "--servers: must be a number of server ranks >= 1 or 'colocated'"),
    (["--servers", "colocated", "--consistency", "sync:3"], "waits for more gradients than the 2"),
])
def test_bad_input_is_an_error_naming_it(data_cache, args, message):
    r = run(mpirun_cmd(2, "--mode", "ps", "--model", model("mlp"), "--data-cache", data_cache,
                       "--steps", 2, *args), timeout=120)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
