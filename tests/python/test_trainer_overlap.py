"""ddpx-train --overlap (issue 24) under mpirun: GradSync stepping the
optimizer bucket by bucket (optimizer) and the next forward gated per
parameter (next-forward) train the scripted LeNet, MLP and HAN to the very
same parameters as the synchronous path (--overlap none: optimizer.step()
after backward), with a learning-rate schedule, SGD with momentum and Adam,
and across a checkpoint and resume; the run reports the forward's waits at
the gates.
"""
import pytest
import torch

from trainer_util import checkpoint_tensors, model, mpirun_cmd, read_metrics, run

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.load


CASES = {
    # model: (flags, steps)
    "lenet": (["--batch-size", 16, "--lr", 0.05, "--momentum", 0.9], 60),
    "mlp": (["--batch-size", 32, "--optimizer", "adam", "--lr", 1e-3, "--weight-decay", 1e-4],
            200),
    "han": (["--train-samples", 400, "--batch-size", 8, "--optimizer", "adam", "--lr", 1e-2], 30),
}


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, data_cache):
    """The synchronous reference (--overlap none) of a model, steps and
    schedule: run once, shared by the tests that compare against it."""
    done = {}

    def get(name, steps, schedule="cosine"):
        key = (name, steps, schedule)
        if key not in done:
            done[key] = train(tmp_path_factory.mktemp("sync"), data_cache, name, "none", steps,
                              schedule=schedule)
        return done[key]
    return get


def train(tmp_path, data_cache, name, overlap, steps, *extra, np=2, tag="", schedule="cosine"):
    flags, _ = CASES[name]
    ckpt = tmp_path / f"{name}-{overlap}{tag}.pt"
    metrics = tmp_path / f"{name}-{overlap}{tag}.jsonl"
    r = run(mpirun_cmd(np, "--model", model(name), "--data-cache", data_cache, "--steps", steps,
                       *flags, "--lr-schedule", schedule, "--warmup-steps", 5, "--overlap",
                       overlap, "--log-every", 10, "--checkpoint", ckpt, "--metrics", metrics,
                       *extra))
    assert r.returncode == 0, r.stdout + r.stderr
    return ckpt, metrics, r


def assert_same(got_ckpt, want_ckpt):
    got, gpos = checkpoint_tensors(got_ckpt)
    want, wpos = checkpoint_tensors(want_ckpt)
    assert gpos == wpos
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), (k, (got[k] - want[k]).abs().max().item())


@pytest.mark.parametrize("name", sorted(CASES))
def test_next_forward_is_bitwise_the_synchronous_path(tmp_path, data_cache, sync_run, name):
    steps = CASES[name][1]
    want, _, _ = sync_run(name, steps)
    got, metrics, r = train(tmp_path, data_cache, name, "next-forward", steps)
    assert_same(got, want)
    end = read_metrics(metrics)[-1]
    assert end["overlap"] == "next-forward"
    assert all("gate_wait_us" in m for m in read_metrics(metrics)[:-1])
    assert "test accuracy" in r.stdout


def test_optimizer_mode_on_three_ranks(tmp_path, data_cache):
    want, _, _ = train(tmp_path, data_cache, "mlp", "none", 80, np=3)
    got, _, _ = train(tmp_path, data_cache, "mlp", "optimizer", 80, np=3)
    assert_same(got, want)


def test_next_forward_resumes_bitwise(tmp_path, data_cache, sync_run):
    """Stopped at step 30 (checkpoint: parameters, optimizer state), resumed to
    60: the same parameters as 60 straight steps without overlap. (A
    schedule that does not depend on the run's length: --steps changes.)"""
    want, _, _ = sync_run("lenet", 60, schedule="constant")
    ckpt, _, _ = train(tmp_path, data_cache, "lenet", "next-forward", 30, tag="-resumed",
                       schedule="constant")
    flags, _ = CASES["lenet"]
    r = run(mpirun_cmd(2, "--model", model("lenet"), "--data-cache", data_cache, "--steps", 60,
                       *flags, "--lr-schedule", "constant", "--warmup-steps", 5, "--overlap",
                       "next-forward", "--checkpoint", ckpt, "--resume", "--log-every", 10))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout
    assert_same(ckpt, want)


@pytest.mark.parametrize("name,lookahead", [("lenet", "true"), ("lenet", "false"),
                                            ("han", "true")])
def test_staleness_one_trains_one_step_late(tmp_path, data_cache, sync_run, name, lookahead):
    """--staleness 1: each update lands at the end of the next backward (with
    the look-ahead, the default, each rank's next forward runs one step
    ahead on its own gradients). Not the synchronous parameters (the updates
    really came late), yet it trains: the loss falls as it does
    synchronously. (Bit for bit against a late apply, with and without the
    look-ahead: test_grad_sync_stale.cpp.)"""
    steps = CASES[name][1]
    want, want_metrics, _ = sync_run(name, steps)
    got, metrics, r = train(tmp_path, data_cache, name, "none", steps, "--staleness", 1,
                            "--stale-warmup", 5, "--stale-lookahead", lookahead, tag="-stale")
    records = read_metrics(metrics)
    assert records[-1]["staleness"] == 1
    assert records[-1]["stale_lookahead"] == (lookahead == "true")
    assert "test accuracy" in r.stdout
    a, _ = checkpoint_tensors(got)
    b, _ = checkpoint_tensors(want)
    assert any(not torch.equal(a[k], b[k]) for k in b)
    steps_logged = [m for m in records if "loss" in m and m.get("event") != "end"]
    sync_logged = [m for m in read_metrics(want_metrics) if "loss" in m and m.get("event") != "end"]
    assert steps_logged[-1]["loss"] < steps_logged[0]["loss"]
    assert steps_logged[-1]["loss"] < 1.5 * sync_logged[-1]["loss"] + 0.05


def test_staleness_with_next_forward_is_refused(tmp_path, data_cache):
    flags, _ = CASES["lenet"]
    r = run(mpirun_cmd(2, "--model", model("lenet"), "--data-cache", data_cache, "--steps", 5,
                       *flags, "--overlap", "next-forward", "--staleness", 1))
    assert r.returncode != 0
    assert "staleness(1)" in r.stdout + r.stderr
