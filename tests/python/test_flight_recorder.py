"""Issue 62: the flight recorder. Each scenario runs a ddpx_mpi job of its
own (fr_scenario.py, 3 ranks) whose ranks dump their recorders; then
`ddpx-trace analyze` and PyTorch's own analyzer (the installed wheel's
torch.distributed.flight_recorder) read the dumps, and both must name the
same rank and sequence number."""
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_job import run_job

SCRIPT = Path(__file__).with_name("fr_scenario.py")
TRACE = os.environ.get("DDPX_TRACE_TOOL", "ddpx-trace")
NP = 3


def run(scenario, tmp_path, **env):
    prefix = str(tmp_path / "rank_")
    rc, out = run_job(NP, [SCRIPT, scenario], timeout=120,
                      mpirun_extra=["--mca", "btl_vader_single_copy_mechanism", "none"],
                      env_extra={"DDPX_TIMEOUT_S": "3", "TORCH_FR_DUMP_TEMP_FILE": prefix, **env})
    assert rc is not None, f"the job hung\n{out}"
    for r in range(NP):
        assert os.path.exists(prefix + str(r)), f"no dump from rank {r}\n{out}"
    return out


def entries(tmp_path, rank):
    with open(tmp_path / f"rank_{rank}", "rb") as f:
        return pickle.load(f)


def seq_of_call(tmp_path, k):
    """collective_seq_id of rank 0's k-th all-reduce (0-based) in group "0"."""
    calls = [e for e in entries(tmp_path, 0)["entries"]
             if e["process_group"][0] == "0" and e["profiling_name"].endswith("all_reduce")]
    return calls[k]["collective_seq_id"]


def ddpx_trace(tmp_path):
    return subprocess.run([TRACE, "analyze", str(tmp_path), "--prefix", "rank_"], check=True,
                          capture_output=True, text=True).stdout


def torch_analyzer(tmp_path):
    """PyTorch's analyzer over the dumps; its database's first collective that
    did not pass its check or that some rank never joined."""
    db_file = tmp_path / "db.pkl"
    subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                    str(tmp_path), "--prefix", "rank_", "-o", str(db_file)], check=True,
                   capture_output=True, text=True)
    with open(db_file, "rb") as f:
        _, db = pickle.load(f)
    failed = [c for c in db.collectives if not c.pass_check or c.missing_ranks]
    return failed[0] if failed else None


@pytest.mark.parametrize("scenario,culprit,kind", [("op", 1, "COLLECTIVE_TYPE_MISMATCH"),
                                                   ("size", NP - 1, "SIZE_OR_SYNTAX_MISMATCH")])
def test_a_rank_that_makes_another_call_is_named(tmp_path, scenario, culprit, kind):
    out = run(scenario, tmp_path)
    assert "ranks disagree" in out, out
    seq = seq_of_call(tmp_path, 3)
    report = ddpx_trace(tmp_path)
    want = f'first disagreement in group "0" (ddpx_mpi, {NP} ranks) at #{seq}'
    assert want in report, report
    line = next(x for x in report.splitlines() if want in x)
    assert f"rank {culprit} {'broadcast' if scenario == 'op' else 'all_reduce 1x[9]'}" in line, \
        report
    c = torch_analyzer(tmp_path)
    assert c is not None and c.collective_seq_id == seq, c
    # PyTorch's analyzer measures every rank against the first dump it read
    # (in directory order): it names the culprit, or, when it started from
    # the culprit's dump, every other rank.
    assert set(c.mismatch_collectives) in ({culprit}, set(range(NP)) - {culprit}), c
    assert {m.type_of_mismatch.state.name for m in c.mismatch_collectives.values()} == {kind}, c


def test_a_rank_that_skipped_a_collective_is_behind(tmp_path):
    out = run("skip", tmp_path)
    assert "timed out" in out and "flight recorder written" in out, out
    seq = seq_of_call(tmp_path, 5)  # the one the last rank never reached
    report = ddpx_trace(tmp_path)
    assert f"reached #{seq} all_reduce" in report, report
    assert f"rank {NP - 1} is 1 collective behind, last seen at #{seq - 1}" in report, report
    c = torch_analyzer(tmp_path)
    assert c is not None and c.collective_seq_id == seq, c
    assert c.missing_ranks == {NP - 1}, c


def test_a_healthy_dump_is_whole_and_the_ring_wraps(tmp_path):
    out = run("healthy", tmp_path, TORCH_FR_BUFFER_SIZE="16")
    dump = entries(tmp_path, 0)
    assert dump["version"] == "2.10"
    assert len(dump["entries"]) == 16  # the newest 16 of 41 calls (40 all-reduces, a barrier)
    ids = [e["record_id"] for e in dump["entries"]]
    assert ids == sorted(ids) and ids[-1] - ids[0] == 15
    assert all(e["state"] == "completed" for e in dump["entries"]), dump["entries"]
    assert dump["entries"][-1]["profiling_name"] == "ddpx_mpi:barrier"
    assert "job is healthy" in ddpx_trace(tmp_path)
    assert torch_analyzer(tmp_path) is None
    assert out.count("RESULT") == NP


def test_the_recorder_off_records_nothing(tmp_path):
    run("healthy", tmp_path, TORCH_FR_BUFFER_SIZE="0")
    assert entries(tmp_path, 0)["entries"] == []
