"""ddpx-train --mode ps (issue 23): the parameter server end to end on the
scripted models, its metrics and summary, and its errors for bad input.

Stated targets (CPU, generated data):
- LeNet, async, 1 server + 2 workers, 200 steps of 32 per worker at lr 0.02:
  test accuracy >= 80% (seen: 87-99.5% over 3 runs: the arrival order, and
  so the run, differs each time). At lr 0.05 with momentum 0.9 as given,
  async stayed near chance; the default --ps-async-momentum auto applies
  0.4 on the server (asynchrony adds about 1 - 1/N) and trains.
- MLP, sync through 1 server + 2 workers: the logged losses equal those of
  --mode sync (GradSync) on 2 ranks to 1e-5 relative (same shards, same
  mean; seen: equal to every printed digit, and on HAN too).
- MLP, 2 servers, sync, fp16 pushes: 50% of float32 on the wire plus headers.
- LeNet, async, 1 server + 2 workers, int8 pulls: >= 80% like float32
  pulls, the pulls at most 0.27 of float32 on the wire (codes, a scale per
  256, the exact first reply).
- LeNet, async, delay compensation 0.5: >= 80%, pushes 2x float32.
- a server frozen by SIGSTOP, or killed with kill -9 (mpirun told to let
  the others live): the workers fail within DDPX_TIMEOUT_S + 15 s, naming it.
- a worker killed with kill -9 (mpirun told to let the others live) or
  frozen by SIGSTOP: the other trains to the end, the two ranks left score
  the servers' parameters (>= 50%; seen 97-99%), status 0.
- MLP, sync, stopped and resumed from the server's checkpoint:
  the same logged losses and test accuracy, exactly.
"""
import re
import signal

import pytest

from trainer_util import (mpirun_cmd, model, ps_stop_and_resume, read_metrics, run,
                          signal_rank_mid_run)


def test_lenet_async(tmp_path, data_cache):
    metrics = tmp_path / "m.jsonl"
    # Worker 2 sleeps 20 ms a step, so worker 1 pushes while it computes and
    # its gradients arrive stale. Left to the scheduler, two workers on a
    # loaded 2-core machine once ran strictly in turn: all 400 updates fresh.
    r = run(mpirun_cmd(3, "--mode", "ps", "--servers", 1, "--consistency", "async",
                       "--model", model("lenet"), "--data-cache", data_cache, "--steps", 200,
                       "--batch-size", 32, "--lr", 0.02, "--log-every", 50, "--metrics", metrics,
                       "--straggler", "2:20"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 server(s) + 2 worker(s), consistency async" in r.stdout
    assert "staleness (versions): mean" in r.stdout
    lines = read_metrics(metrics)
    assert [m["step"] for m in lines[:-1]] == [50, 100, 150, 200]
    end = lines[-1]
    assert end["event"] == "end" and end["updates"] == 400 and end["applied"] == 400, end
    assert end["test_accuracy"] >= 0.80, end
    st = end["staleness"]
    assert set(st) == {"mean", "p50", "p99", "max", "histogram"}
    assert sum(st["histogram"].values()) == 400 and st["max"] >= 1, st
    assert end["compression"] == pytest.approx(1.0, abs=0.01), end


@pytest.mark.parametrize("consistency", ["async", "ssp:0", "ssp:2"])
def test_async_trains_at_the_default_lr_and_momentum(tmp_path, data_cache, consistency):
    """The flags a user starts from (lr 0.05, momentum 0.9): 2 asynchronous
    workers add about 0.5 momentum of their own, so the server applies 0.4
    and says so; with 0.9 as given LeNet stayed at 10-16% (seen)."""
    metrics = tmp_path / "m.jsonl"
    r = run(mpirun_cmd(3, "--mode", "ps", "--consistency", consistency, "--model",
                       model("lenet"), "--data-cache", data_cache, "--steps", 150,
                       "--batch-size", 32, "--log-every", 50, "--metrics", metrics))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the server applies 0.4 for --momentum 0.9" in r.stdout, r.stdout
    end = read_metrics(metrics)[-1]
    assert end["test_accuracy"] >= 0.80, end


def test_sync_through_a_server_equals_gradsync(tmp_path, data_cache):
    common = ["--model", model("mlp"), "--data-cache", data_cache, "--steps", 20,
              "--batch-size", 32, "--log-every", 5]
    ref, ps = tmp_path / "ref.jsonl", tmp_path / "ps.jsonl"
    r = run(mpirun_cmd(2, *common, "--metrics", ref))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(mpirun_cmd(3, "--mode", "ps", "--consistency", "sync", *common, "--metrics", ps))
    assert r.returncode == 0, r.stdout + r.stderr
    want = [m["loss"] for m in read_metrics(ref) if "event" not in m]
    got = [m["loss"] for m in read_metrics(ps) if "event" not in m]
    assert len(got) == len(want) == 4
    assert got == pytest.approx(want, rel=1e-5), (got, want)


def test_two_servers_fp16_pushes(tmp_path, data_cache):
    metrics = tmp_path / "m.jsonl"
    r = run(mpirun_cmd(4, "--mode", "ps", "--servers", 2, "--consistency", "sync",
                       "--codec", "fp16", "--model", model("mlp"), "--data-cache", data_cache,
                       "--steps", 10, "--batch-size", 32, "--log-every", 5,
                       "--metrics", metrics))
    assert r.returncode == 0, r.stdout + r.stderr
    end = read_metrics(metrics)[-1]
    assert end["updates"] == 10 and end["dropped"] == 0 and end["staleness"]["max"] == 0, end
    assert 0.5 <= end["compression"] < 0.501, end


def test_lenet_async_int8_pulls(tmp_path, data_cache):
    metrics = tmp_path / "m.jsonl"
    r = run(mpirun_cmd(3, "--mode", "ps", "--ps-pull-codec", "int8", "--model", model("lenet"),
                       "--data-cache", data_cache, "--steps", 200, "--batch-size", 32, "--lr", 0.02,
                       "--log-every", 100, "--metrics", metrics))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pull codec int8" in r.stdout and "pulls x0.2" in r.stdout, r.stdout
    end = read_metrics(metrics)[-1]
    assert end["test_accuracy"] >= 0.80, end
    assert 0.25 < end["pull_compression"] <= 0.27, end
    assert end["compression"] == pytest.approx(1.0, abs=0.01), end


def test_lenet_async_delay_compensation(tmp_path, data_cache):
    """DC-ASGD on: trains like plain async; each push carries g*g*w_base
    beside the gradient, twice the float32 bytes."""
    metrics = tmp_path / "m.jsonl"
    r = run(mpirun_cmd(3, "--mode", "ps", "--ps-delay-comp", 0.5, "--model", model("lenet"),
                       "--data-cache", data_cache, "--steps", 200, "--batch-size", 32, "--lr", 0.02,
                       "--log-every", 100, "--metrics", metrics))
    assert r.returncode == 0, r.stdout + r.stderr
    end = read_metrics(metrics)[-1]
    assert end["test_accuracy"] >= 0.80, end
    assert 2.0 <= end["compression"] < 2.01, end


def test_resume_equals_uninterrupted(tmp_path, data_cache):
    """sync with int8 pushes: stopped after 12 of 20 steps and resumed from
    the server's checkpoint and each worker's saved residuals, the run ends
    with the same loss and test accuracy (the server's parameters are
    bitwise those of the uninterrupted run; the C++ test checks that with 2
    servers too, and that without the residuals int8 would not)."""
    common = ["--mode", "ps", "--consistency", "sync", "--model", model("mlp"), "--codec", "int8",
              "--data-cache", data_cache, "--batch-size", 16, "--log-every", 4]

    def fresh_run_refuses(ckpt, m):
        r = run(mpirun_cmd(3, *common, "--steps", 12, "--checkpoint", ckpt, "--metrics", m))
        assert r.returncode != 0 and "already exists; pass --resume" in r.stderr, r.stderr
    r, end = ps_stop_and_resume(tmp_path, 3, common, fresh_run_refuses)
    assert "resumed the servers" in r.stdout
    assert end["updates"] == 20


@pytest.mark.parametrize("args,np,message", [
    (["--servers", 2], 2, "--servers must be in [1, 1]"),
    (["--consistency", "eventually"], 2, "unknown consistency 'eventually'"),
    (["--codec", "powersgd:2"], 2, "has no point-to-point form"),
    (["--ps-pull-codec", "zip"], 2, "pull codec: ddpx: unknown codec 'zip'"),
    (["--consistency", "sync", "--ps-delay-comp", 0.5], 2, "would do nothing"),
    (["--ps-async-momentum", "half"], 3, "--ps-async-momentum"),
])
def test_bad_input_is_an_error_naming_it(data_cache, args, np, message):
    r = run(mpirun_cmd(np, "--mode", "ps", "--model", model("mlp"), "--data-cache", data_cache,
                       "--steps", 2, *args), timeout=120)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["sigstop", "kill-9"])
def test_lost_server_fails_the_workers_in_time(tmp_path, data_cache, sig):
    """SIGSTOP the server mid-run, or kill -9 it with mpirun told to let the
    others live: the workers fail within DDPX_TIMEOUT_S (5 s) plus a margin,
    naming it, and the job ends (a frozen server with it)."""
    out, rc, elapsed, _, status = signal_rank_mid_run(tmp_path, data_cache, 1000000, 0, sig)
    # (Under recovery mpirun itself says 0; ddpx-run reads the status.)
    assert rc != 0, out
    assert elapsed <= 5 + 15, f"{elapsed:.1f} s\n{out}"
    assert "server 0 (rank 0) sent nothing for 5 s" in out, out
    assert status.startswith("failed: ") and "server 0 (rank 0) sent nothing" in status, status
    if sig == signal.SIGKILL:
        assert "ddpx-run: the job failed: failed: " in out, out


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "sigstop"])
def test_lost_worker_the_others_finish(tmp_path, data_cache, sig):
    """Kill -9 (mpirun told to let the others live) or SIGSTOP worker 1
    mid-run: the server drops it after DDPX_TIMEOUT_S (5 s), worker 0
    trains to the end, the ranks left share the final parameters and score
    them, and the job ends with status 0 (the frozen one ended by rank 0's
    MPI_Abort(0) at exit)."""
    out, rc, _, marker, status = signal_rank_mid_run(tmp_path, data_cache, 300, 2, sig)
    assert rc == 0, out
    assert status == "ok, ranks lost: 2", status
    assert "worker 1 (rank 2) sent nothing for 5 s: dropped" in out, out
    # Worker 0 is still training or has finished, never "0 workers".
    m = re.search(r"dropped \(workers: (\d+) still training, (\d+) finished, (\d+) dropped\)", out)
    assert m and int(m[1]) + int(m[2]) == 1 and m[3] == "1", out
    assert "finishing without the worker(s) the servers dropped (rank 2)" in out, out
    assert "1 worker(s) lost" in out, out
    done = [ln for ln in out.splitlines() if "test accuracy" in ln]
    assert done, out
    acc = float(done[-1].rsplit("test accuracy", 1)[1].strip().rstrip("%"))
    assert acc >= 50, out
    end = read_metrics(marker)[-1]
    assert end["event"] == "end" and end["test_accuracy"] == pytest.approx(acc / 100, abs=1e-4)
