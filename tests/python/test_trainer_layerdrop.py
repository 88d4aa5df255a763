"""ddpx-train --layer-drop (issue 25) on the scripted transformer, under
mpirun: a shared pattern keeps the dropped blocks off the wire (the bytes of
each step are exactly the kept blocks' and the rest), the same pattern comes
back after a resume (same losses, bit for bit), the per-rank pattern trains
through GradSync's unused-parameter handling, and the errors for bad use.
"""
import re

import pytest
import torch

from trainer_util import model, mpirun_cmd, read_metrics, run

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.load

DEPTH = 6


@pytest.fixture(scope="module")
def sizes():
    """Bytes (float32) of one block, and of everything outside the blocks."""
    m = torch.jit.load(model("transformer"))
    block = sum(p.numel() for n, p in m.named_parameters() if n.startswith("blocks.0.")) * 4
    rest = sum(p.numel() for n, p in m.named_parameters() if not n.startswith("blocks.")) * 4
    return block, rest


def common(data_cache, steps, *extra):
    return ["--model", model("transformer"), "--data-cache", data_cache, "--train-samples", 2000,
            "--steps", steps, "--batch-size", 8, "--lr", 0.05, *extra]


def steps_of(path):
    return [m for m in read_metrics(path) if "event" not in m]


def test_shared_pattern_sends_only_the_kept_blocks(tmp_path, data_cache, sizes):
    block, rest = sizes
    metrics = tmp_path / "m.jsonl"
    r = run(mpirun_cmd(2, *common(data_cache, 16, "--layer-drop", "pld:0.5", "--pld-gamma", 0.2,
                                  "--log-every", 1, "--metrics", metrics)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "layer drop: pld:0.5 gamma 0.2 shared inverse seed 1 over 6 blocks" in r.stdout
    assert re.search(r"kept \d\.\d\d", r.stdout)
    lines = steps_of(metrics)
    assert len(lines) == 16
    kept = [m["kept_fraction"] for m in lines]
    assert min(kept) < 1.0, kept  # theta falls to 0.5 within the run: blocks do drop
    for m in lines:
        # log-every 1: the step's own kept fraction, the same on every rank
        kept_blocks = round(m["kept_fraction"] * DEPTH)
        assert m["bytes_reduced"] == rest + kept_blocks * block, m
    # (Re-plans happen here as without dropping: the transformer's backward
    # order is learnt; test_grad_sync's GradSyncLayerDrop shows none come
    # from the drops.)
    end = read_metrics(metrics)[-1]
    assert end["layer_drop"] == "pld:0.5 gamma 0.2 shared inverse seed 1"


def test_no_drop_sends_every_block(tmp_path, data_cache, sizes):
    block, rest = sizes
    metrics = tmp_path / "m.jsonl"
    r = run(mpirun_cmd(2, *common(data_cache, 4, "--log-every", 1, "--metrics", metrics)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(m["bytes_reduced"] == rest + DEPTH * block for m in steps_of(metrics))


def test_resume_continues_the_same_pattern(tmp_path, data_cache):
    flags = ["--layer-drop", "constant:0.3", "--log-every", 2]
    straight, first, second = (tmp_path / f"{n}.jsonl" for n in ("straight", "first", "second"))
    r = run(mpirun_cmd(2, *common(data_cache, 12, *flags, "--metrics", straight)))
    assert r.returncode == 0, r.stdout + r.stderr
    ckpt = tmp_path / "ckpt.pt"
    r = run(mpirun_cmd(2, *common(data_cache, 6, *flags, "--metrics", first, "--checkpoint",
                                  ckpt)))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(mpirun_cmd(2, *common(data_cache, 12, *flags, "--metrics", second, "--checkpoint",
                                  ckpt, "--resume")))
    assert r.returncode == 0, r.stdout + r.stderr
    want = steps_of(straight)
    got = steps_of(first) + steps_of(second)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    assert [m["kept_fraction"] for m in got] == [m["kept_fraction"] for m in want]
    assert [m["loss"] for m in got] == [m["loss"] for m in want]
    # Another schedule does not continue this run.
    r = run(mpirun_cmd(2, *common(data_cache, 14, "--layer-drop", "constant:0.5", "--checkpoint",
                                  ckpt, "--resume")))
    assert r.returncode != 0
    assert "layer drop 'constant:0.3 shared inverse seed 1'" in r.stderr + r.stdout


def test_per_rank_pattern_trains_through_unused_handling(tmp_path, data_cache, sizes):
    block, rest = sizes
    metrics = tmp_path / "m.jsonl"
    r = run(mpirun_cmd(2, *common(data_cache, 12, "--layer-drop", "stochastic-depth:0.5",
                                  "--layer-drop-pattern", "per-rank", "--log-every", 4,
                                  "--metrics", metrics)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stochastic-depth:0.5 per-rank" in r.stdout
    end = read_metrics(metrics)[-1]
    assert end["test_accuracy"] >= 0.0 and end["layer_drop"].startswith("stochastic-depth:0.5")


@pytest.mark.parametrize("extra,message", [
    (["--layer-drop", "pld:0"], "theta-bar after 'pld:'"),
    (["--layer-drop", "constant:1.5"], "must be in [0, 1)"),
    (["--layer-drop", "sometimes"], "--layer-drop must be none, constant:P"),
    (["--layer-drop", "constant:0.2", "--layer-drop-pattern", "per-rank", "--unused", "off"],
     "needs --unused predict or exact"),
])
def test_bad_flags_are_named(tmp_path, data_cache, extra, message):
    r = run(mpirun_cmd(2, *common(data_cache, 2, *extra)))
    assert r.returncode != 0
    assert message in r.stderr + r.stdout, r.stderr


def test_a_model_without_blocks_is_refused(data_cache):
    r = run(mpirun_cmd(2, "--model", model("mlp"), "--data-cache", data_cache, "--steps", 2,
                       "--layer-drop", "constant:0.2"))
    assert r.returncode != 0
    assert "List[float] attribute 'block_scale'" in r.stderr + r.stdout, r.stderr
