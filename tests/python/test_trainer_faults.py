"""A lost rank ends the job with an error, never a hang: kill -9 one rank,
or freeze it (SIGSTOP), under mpirun and under torchrun. And the job says
where every rank was (issue 62): the flight recorder's one screen names the
frozen rank, and a rank stuck in its data path as collectives behind.

Bounds (stated): with DDPX_TIMEOUT_S=T the job ends within T + 15 s under
mpirun (a frozen peer: the others time out after T and abort the MPI job,
which also kills the frozen one), and within T + 45 s under torchrun (its
agent sends SIGTERM, which a stopped process holds, and SIGKILL after 30 s).
"""
import os
import re
import signal
import time

import pytest

from trainer_util import (env, kill_group, model, mpirun_cmd, rank_pid, read_until, start,
                          torchrun_cmd, wait_for)

T = 10  # DDPX_TIMEOUT_S for these runs


def launch(launcher, tmp_path, data, extra=()):
    marker = str(tmp_path / "marker.ckpt")  # unique per test: finds our ranks
    args = ["--model", model("mlp"), "--data-cache", data, "--steps", 1000000, "--batch-size",
            16, "--log-every", 20, "--checkpoint", marker,
            "--status-file", tmp_path / "status", *extra]
    cmd = mpirun_cmd(2, *args) if launcher == "mpirun" else torchrun_cmd(2, *args)
    p = start(cmd, env=env(DDPX_TIMEOUT_S=T))
    rank_var = "OMPI_COMM_WORLD_RANK" if launcher == "mpirun" else "RANK"
    lines = []
    read_until(p, lines, "step 20/", 300)  # training under way (a progress line from rank 0)
    assert p.poll() is None, "".join(lines)
    pid = wait_for(lambda: rank_pid(marker, 1, rank_var), 30, "rank 1's pid")
    return p, pid, lines


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


# (stale: GradSync --staleness 1, where a step's reductions complete on a
# worker thread during the next step: the failure must still end the job.)
@pytest.mark.parametrize("launcher,mode", [("mpirun", "sync"), ("torchrun", "sync"),
                                           ("mpirun", "stale")])
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_lost_rank_ends_the_job(tmp_path, data, launcher, mode, sig):
    extra = ["--staleness", 1, "--stale-warmup", 2] if mode == "stale" else []
    p, pid, lines = launch(launcher, tmp_path, data, extra)
    try:
        t0 = time.monotonic()
        os.kill(pid, getattr(signal, sig))
        bound = T + (15 if launcher == "mpirun" else 45)
        out, _ = p.communicate(timeout=bound + 30)
        elapsed = time.monotonic() - t0
        time.sleep(1)
        survivors = [pid for r in (0, 1) for v in ("OMPI_COMM_WORLD_RANK", "RANK")
                     if (pid := rank_pid(str(tmp_path / "marker.ckpt"), r, v))]
    finally:
        kill_group(p)
    out = "".join(lines) + out
    assert p.returncode != 0, out
    # The status file never says ok: a survivor that timed out says why; a
    # job the launcher ended at once may still say "running".
    status = (tmp_path / "status").read_text().strip()
    assert not status.startswith("ok"), status
    if sig == "SIGSTOP":
        assert status.startswith("failed: rank 0 of 2"), status
    assert elapsed <= bound, f"{elapsed:.1f} s > {bound} s\n{out}"
    if sig == "SIGSTOP":
        # The survivors say what happened: a timeout waiting for a peer.
        assert "timed out" in out.lower() or "timeout" in out.lower(), out
        assert "ddpx-train (rank 0 of 2" in out, out
        # The frozen one is named: ddpx_mpi asks the peers over MPI; under
        # torchrun (Gloo) GradSync asks them on the store (comm::roll_call).
        assert "rank 1 of this group did not answer" in out, out
        # The flight recorder's screen: rank 0's buffer, rank 1 silent, and
        # where rank 0 waited (GradSync's step and bucket).
        assert "ddpx flight recorder: rank 0 answered; rank 1 did not" in out, out
        assert re.search(r"rank 0: done #\d+ all_reduce .*\(step \d+, bucket \d+", out), out
    else:
        # The launcher names the dead rank.
        named = ("rank 1" in out) if launcher == "mpirun" else ("local_rank: 1" in out or
                                                                 "rank: 1" in out)
        assert named, out
    assert not survivors, f"ranks still alive after the launcher exited: {survivors}"


def test_a_rank_stuck_in_its_data_path_is_reported_behind(tmp_path, data):
    """Rank 1 sleeps in its data path before step 25 while rank 0 waits in
    that step's first reduction: rank 0 times out, and the screen, with rank
    1's buffer (its responder answers while it sleeps), says rank 1 is
    collectives behind, last seen in step 24."""
    args = ["--model", model("mlp"), "--data-cache", data, "--steps", 60, "--batch-size", 16,
            "--log-every", 20, "--status-file", tmp_path / "status"]
    p = start(mpirun_cmd(2, *args),
              env=env(DDPX_TIMEOUT_S=T, DDPX_TRAIN_STALL_AT="25:1:600",
                      TORCH_FR_DUMP_TEMP_FILE=tmp_path / "fr_"))
    try:
        out, _ = p.communicate(timeout=T + 60)
    finally:
        kill_group(p)
    assert p.returncode != 0, out
    assert "ddpx flight recorder: ranks 0 and 1 answered" in out, out
    # (A bucket's reduction, or the step's agreement after its buckets.)
    m = re.search(r"ranks? 0 reached #(\d+) all_reduce .*\(step 25[,)].*"
                  r"rank 1 is (\d+) collectives? behind, last seen at #(\d+) all_reduce "
                  r".*\(step 24[,)].*\(done\)", out)
    assert m, out
    top, behind, last = map(int, m.groups())
    assert top - last == behind >= 1, out
    assert (tmp_path / "fr_0").exists()  # rank 0's own dump, written when it timed out
