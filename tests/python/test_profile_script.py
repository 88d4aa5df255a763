"""scripts/trace_report.py on a trace recorded by GradSync (the 2-rank
test_profiler run writes it: ctest fixture `profiler_trace`)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "trace_report.py"


@pytest.fixture(scope="module")
def trace():
    path = os.environ.get("DDPX_PROFILER_TRACE")
    if not path or not Path(path).is_file():
        pytest.fail(f"no recorded trace at DDPX_PROFILER_TRACE={path!r}: run through ctest "
                    "(the test_profiler_np2 fixture records it)")
    return path


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_summary_table_has_every_rank_and_metric(trace):
    r = run(trace)
    assert r.returncode == 0, r.stderr
    assert "3 steps" in r.stdout and "2 ranks" in r.stdout, r.stdout
    for row in ("compute (backward)", "communication", "exposed communication",
                "overlap efficiency", "hook CPU per parameter tensor", "bytes sent",
                "compression ratio", "re-planning events", "unused mispredictions"):
        assert row in r.stdout, r.stdout
    # float32 buckets, codec none: compression is exactly 1 on both ranks.
    line = next(l for l in r.stdout.splitlines() if "compression ratio" in l)
    assert line.split()[2:4] == ["1.000", "1.000"], line


def test_steps_window(trace):
    r = run(trace, "--steps", "3:3")
    assert r.returncode == 0, r.stderr
    assert "1 steps" in r.stdout, r.stdout
    r = run(trace, "--steps", "40:50")
    assert r.returncode != 0 and "no ddpx GradSync steps" in r.stderr + r.stdout


def test_renders_a_png(trace, tmp_path):
    import matplotlib.image as mpimg
    import numpy as np

    png = tmp_path / "profile.png"
    r = run(trace, "--png", png, "--plot-steps", "2")
    assert r.returncode == 0, r.stderr
    assert png.stat().st_size > 20_000
    img = mpimg.imread(png)[..., :3]
    assert img.shape[0] > 300 and img.shape[1] > 800
    # Bars, not a blank canvas: a real share of the pixels are neither white
    # nor grey, and several distinct colours are used.
    coloured = (img.max(axis=2) - img.min(axis=2)) > 0.15
    assert coloured.mean() > 0.02, coloured.mean()
    colours = {tuple(c) for c in (img[coloured] * 16).astype(int)}
    assert len(colours) >= 6, len(colours)


def test_not_a_trace_is_an_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    r = run(bad)
    assert r.returncode != 0 and "not a Chrome trace" in r.stderr + r.stdout


def test_tracks_nest_properly(trace):
    """Chrome/Perfetto draw the spans of one track as a stack: any two on the
    same (pid, tid) must be disjoint or one inside the other."""
    import json
    from collections import defaultdict

    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    tracks = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    assert len({pid for pid, _ in tracks}) == 2
    eps = 0.002  # us: timestamps carry ns
    for key, spans in tracks.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack = []
        for a, b, name in spans:
            while stack and stack[-1][1] <= a + eps:
                stack.pop()
            if stack:
                assert b <= stack[-1][1] + eps, f"{key}: {name} [{a}, {b}] crosses {stack[-1]}"
            stack.append((a, b, name))
