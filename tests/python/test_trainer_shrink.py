"""Issue 46, part 3: in-place shrink under mpirun (--on-rank-loss shrink).

HAN, 600 samples, --global-batch 12: one epoch is 50 steps. Three ranks
start under ddpx-run (mpirun's recovery mode); one is lost mid-run (it exits
after step 20 through the trainer's test hook, or is killed with kill -9, or
frozen with SIGSTOP), the other two find it by the timeout (3 s), agree on
who is left, take the most advanced one's state and redo the failed step at
2 ranks. The reference is the same run switched from 3 to 2 ranks at the
same step through a checkpoint (test_trainer_elastic.py shows that switch
equals an uninterrupted run up to summation order): the parameters agree to
1e-6. The sample log shows every sample of the epoch used exactly once.
"""
import json
import os
import signal
from pathlib import Path

import pytest

from trainer_util import (checkpoint_params, ddpx_run_cmd, env, kill_group, model, mpirun_cmd,
                          rank_pid, read_metrics, read_until, run, start, wait_for)

SAMPLES, GLOBAL, STEPS = 600, 12, 50
COMMON = ["--model", model("han"), "--train-samples", SAMPLES, "--global-batch", GLOBAL,
          "--steps", STEPS, "--lr", 0.05, "--lr-schedule", "constant", "--seed", 7,
          "--log-every", 1, "--timeout-s", 3]
SHRINK = ["--on-rank-loss", "shrink"]


def replaced(args, flag, value):
    """`args` with `flag`'s value set to `value` (None: the flag dropped)."""
    out, i = [], 0
    while i < len(args):
        if args[i] == flag:
            if value is not None:
                out += [flag, value]
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


def switched_at(tmp_path, data_cache, step):
    """The reference: 3 ranks to `step`, then 2 ranks to the end."""
    ckpt = tmp_path / f"ref{step}.ckpt"
    common = [*COMMON, "--data-cache", data_cache, "--checkpoint", ckpt]
    r = run(mpirun_cmd(3, *replaced(common, "--steps", step)))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(mpirun_cmd(2, *common, "--resume"))
    assert r.returncode == 0, r.stdout + r.stderr
    return checkpoint_params(ckpt)


def read_samples(base):
    """{step: {rank: samples}} of each step's last attempt (the smallest
    world: a failed step is logged again by the survivors)."""
    seen = {}
    for f in Path(base).parent.glob(Path(base).name + ".*"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            seen.setdefault(r["step"], []).append(r)
    out = {}
    for step, rows in seen.items():
        world = min(r["world"] for r in rows)
        out[step] = {r["rank"]: r["samples"] for r in rows if r["world"] == world}
    return out


def check_run(tmp_path, data_cache, out, status, metrics, samples):
    events = [m for m in read_metrics(metrics) if m.get("event") == "shrink"]
    assert len(events) == 1 and events[0]["world"] == 2, (events, out)
    step = events[0]["step"]
    assert f"going on with 2 rank(s) from step {step}" in out, out
    assert read_metrics(metrics)[-1]["event"] == "end"
    # Every sample of the epoch once; 3 ranks' slices before, 2 after.
    log = read_samples(samples)
    assert sorted(log) == list(range(STEPS))
    used = [s for st in range(STEPS) for r in log[st].values() for s in r]
    assert sorted(used) == list(range(SAMPLES)), "a sample missed or used twice"
    assert all(len(log[st]) == (3 if st < step else 2) for st in range(STEPS)), log
    got, gstep = checkpoint_params(tmp_path / "run.ckpt")
    want, wstep = switched_at(tmp_path, data_cache, step)
    assert gstep == wstep == STEPS
    for k in want:
        assert (got[k] - want[k]).abs().max() <= 1e-6, (k, (got[k] - want[k]).abs().max())
    return step


def shrink_run(tmp_path, data_cache, extra_env=None, extra=()):
    status = tmp_path / "status"
    samples = tmp_path / "samples"
    cmd = ddpx_run_cmd(3, *COMMON, *SHRINK, *extra, "--data-cache", data_cache, "--checkpoint",
                       tmp_path / "run.ckpt", "--metrics", tmp_path / "m.jsonl",
                       status_file=status)
    r = run(cmd, timeout=300,
            env=env(DDPX_TRAIN_SAMPLE_LOG=str(samples), **(extra_env or {})))
    text = status.read_text().strip() if status.exists() else "(none)"
    return r, text, samples


def test_a_rank_that_exits_is_left_behind(tmp_path, data_cache):
    r, status, samples = shrink_run(tmp_path, data_cache, {"DDPX_TRAIN_FAIL_AT": "20:2"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert status == "ok, ranks lost: 2", (status, out)
    assert check_run(tmp_path, data_cache, out, status, tmp_path / "m.jsonl", samples) == 20


def test_a_rank_lost_after_the_last_step(tmp_path, data_cache):
    # Rank 2 exits once its last step is done: the survivors' closing
    # collectives (the trace flush, the test-set evaluation) fail, and they
    # shrink there as in a step, then evaluate over the two of them.
    r, status, samples = shrink_run(tmp_path, data_cache, {"DDPX_TRAIN_FAIL_AT": f"{STEPS}:2"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert status == "ok, ranks lost: 2", (status, out)
    assert check_run(tmp_path, data_cache, out, status, tmp_path / "m.jsonl", samples) == STEPS
    assert "test accuracy" in out, out


def signal_mid_run(cmd, marker, rank, sig, run_env):
    """Starts `cmd`, sends `sig` to world rank `rank` once step 15 is logged,
    waits for the job: (output, exit code, whether that rank's process is
    gone when the job has ended)."""
    p = start(cmd, env=run_env)
    lines = []
    try:
        read_until(p, lines, "step 15/", 120)
        assert p.poll() is None, "".join(lines)
        pid = wait_for(lambda: rank_pid(marker, rank, "OMPI_COMM_WORLD_RANK"), 30, "the pid")
        os.kill(pid, sig)
        out, _ = p.communicate(timeout=180)
        stat = Path(f"/proc/{pid}/stat")
        gone = not stat.exists() or stat.read_text().split()[2] in ("Z", "X")
    finally:
        kill_group(p)
    return "".join(lines) + out, p.returncode, gone


@pytest.mark.parametrize("rank,sig", [(0, signal.SIGKILL), (1, signal.SIGSTOP)])
def test_killed_or_frozen_rank(tmp_path, data_cache, rank, sig):
    # kill -9 of rank 0 (the lead, which writes the metrics: rank 1 takes
    # over) or SIGSTOP of rank 1 (alive to MPI, silent: found by the timeout
    # alone; the survivors end it once they have agreed).
    marker = str(tmp_path / "m.jsonl")
    status = tmp_path / "status"
    samples = tmp_path / "samples"
    cmd = ddpx_run_cmd(3, *COMMON, *SHRINK, "--data-cache", data_cache, "--checkpoint",
                       tmp_path / "run.ckpt", "--metrics", marker, status_file=status)
    out, rc, gone = signal_mid_run(cmd, marker, rank, sig, env(DDPX_TRAIN_SAMPLE_LOG=str(samples)))
    text = status.read_text().strip()
    assert rc == 0, out
    assert gone, "the lost rank outlived the job"
    assert text == f"ok, ranks lost: {rank}", (text, out)
    step = check_run(tmp_path, data_cache, out, text, marker, samples)
    assert step >= 15


def test_frozen_rank_where_no_survivor_runs(tmp_path, data_cache):
    # DDPX_TRAIN_KEEP_LOST: the survivors leave the frozen rank alone, as on
    # another host. They finish and write the outcome; mpirun would wait for
    # the frozen rank for ever, so ddpx-run ends it --linger-s later.
    marker = str(tmp_path / "m.jsonl")
    status = tmp_path / "status"
    cmd = ddpx_run_cmd(3, *COMMON, *SHRINK, "--data-cache", data_cache, "--metrics", marker,
                       status_file=status)
    cmd.insert(cmd.index("--"), "--linger-s=4")
    out, rc, gone = signal_mid_run(cmd, marker, 1, signal.SIGSTOP, env(DDPX_TRAIN_KEEP_LOST="1"))
    assert rc == 0, out
    assert status.read_text().strip() == "ok, ranks lost: 1", out
    assert "mpirun has not ended 4 s later" in out, out
    assert gone, "the frozen rank outlived the job"


def test_below_min_ranks_fails_clearly(tmp_path, data_cache):
    r, status, _ = shrink_run(tmp_path, data_cache, {"DDPX_TRAIN_FAIL_AT": "10:1"},
                              ["--min-ranks", 3])
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "lost rank(s) [1]; 2 left ([0 2]), fewer than --min-ranks 3" in out, out
    assert status.startswith("failed: ") and "--min-ranks 3" in status, status


def test_global_batch_not_divisible_by_the_ranks_left(tmp_path, data_cache):
    common = replaced(COMMON, "--global-batch", 9)
    status = tmp_path / "status"
    r = run(ddpx_run_cmd(3, *common, *SHRINK, "--data-cache", data_cache, status_file=status),
            timeout=300, env=env(DDPX_TRAIN_FAIL_AT="5:2"))
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "--global-batch 9 is not divisible by the 2 rank(s) left" in out, out


@pytest.mark.parametrize("extra,message", [
    ([], "needs mpirun's recovery mode"),  # plain mpirun
    (["--global-batch", None], "needs --global-batch"),
    (["--overlap", "optimizer"], "needs --overlap none"),
])
def test_bad_input_at_start(tmp_path, data_cache, extra, message):
    args = [*COMMON, *SHRINK, "--data-cache", data_cache]
    if extra:
        args = replaced(args, extra[0], extra[1]) if extra[0] in args else args + extra
    if extra:
        cmd = ddpx_run_cmd(2, *args, status_file=tmp_path / "status")
    else:
        cmd = mpirun_cmd(2, *args)
    r = run(cmd, timeout=120)
    assert r.returncode != 0
    assert message in r.stdout + r.stderr, r.stdout + r.stderr
