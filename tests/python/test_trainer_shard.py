"""ddpx-train --shard (issue 61): ZeRO-1/2 for the scripted models under
mpirun. Sharded runs end at the very parameters of the unsharded run; a
sharded checkpoint (every rank's part of the optimizer state) resumes at
another world size, sharded or not; a rank lost under --on-rank-loss shrink
sends the survivors back to the last checkpoint (its part of the state is
gone with it), re-split over the ranks left; --codec bf16 sharded is the
unsharded bf16 run; --clip-grad-norm clips alike wherever the step runs;
bad combinations fail before any rank starts, naming both options.
"""
import pytest
import torch

from trainer_util import (checkpoint_params, checkpoint_tensors, ddpx_run_cmd, env, model,
                          mpirun_cmd, read_metrics, run)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.load

MLP = ["--model", model("mlp"), "--optimizer", "adam", "--lr", 1e-3, "--seed", 3, "--log-every", 10]
COSINE = ["--lr-schedule", "cosine", "--warmup-steps", 5]  # (over --steps: the same in both runs)


def train(tmp_path, data_cache, np, name, *extra, steps=40):
    ckpt = tmp_path / f"{name}.ckpt"
    metrics = tmp_path / f"{name}.jsonl"
    r = run(mpirun_cmd(np, *MLP, "--data-cache", data_cache, "--steps", steps, "--checkpoint",
                       ckpt, "--metrics", metrics, *extra))
    assert r.returncode == 0, r.stdout + r.stderr
    return ckpt, r.stdout


def test_sharded_runs_are_bitwise_the_unsharded_run(tmp_path, data_cache):
    want, _ = train(tmp_path, data_cache, 2, "none", "--batch-size", 32, *COSINE)
    for shard, overlap in (("optimizer", "none"), ("gradients", "next-forward")):
        got, out = train(tmp_path, data_cache, 2, shard, "--batch-size", 32, *COSINE, "--shard",
                         shard, "--overlap", overlap)
        assert ("ZeRO-1" if shard == "optimizer" else "ZeRO-2") in out, out
        assert "memory: optimizer state" in out, out
        g, gpos = checkpoint_tensors(got)
        w, wpos = checkpoint_tensors(want)
        assert gpos == wpos and g.keys() == w.keys()
        for k in w:
            assert torch.equal(g[k], w[k]), (shard, k, (g[k] - w[k]).abs().max().item())


def test_a_sharded_bf16_run_is_bitwise_the_unsharded_bf16_run(tmp_path, data_cache):
    """The codec's sharded form (Codec::reduce_scatter_mean_packed): the same
    encoding, residuals and rank-order sums, so the same parameters."""
    common = ["--batch-size", 32, "--codec", "bf16"]
    want, _ = train(tmp_path, data_cache, 2, "none", *common, steps=20)
    got, out = train(tmp_path, data_cache, 2, "zero2", *common, "--shard", "gradients",
                     "--overlap", "optimizer", steps=20)
    assert "ZeRO-2" in out and "codec bf16" in out, out
    g, _ = checkpoint_params(got)
    w, _ = checkpoint_params(want)
    assert g.keys() == w.keys()
    for k in w:
        assert torch.equal(g[k], w[k]), (k, (g[k] - w[k]).abs().max().item())


def test_a_sharded_checkpoint_resumes_at_another_world_size(tmp_path, data_cache):
    """3 ranks to step 20, then 2 to 40 (--global-batch keeps the batches):
    sharded on both sides, and sharded then unsharded, against the
    unsharded switch (summation order aside, the same run)."""
    batch = ["--global-batch", 48]
    ref = tmp_path / "ref"
    ref.mkdir()
    train(ref, data_cache, 3, "run", *batch, steps=20)
    want_ckpt, _ = train(ref, data_cache, 2, "run", *batch, "--resume")
    want, _ = checkpoint_params(want_ckpt)
    for second in ("gradients", "none"):
        d = tmp_path / second
        d.mkdir()
        train(d, data_cache, 3, "run", *batch, "--shard", "optimizer", steps=20)
        got_ckpt, out = train(d, data_cache, 2, "run", *batch, "--shard", second, "--resume")
        assert "resumed from" in out and "written by 3 rank(s)" in out, out
        got, step = checkpoint_params(got_ckpt)
        assert step == 40
        for k in want:
            assert (got[k] - want[k]).abs().max() <= 1e-6, (second, k)


def test_a_lost_rank_sends_the_survivors_back_to_the_last_checkpoint(tmp_path, data_cache):
    """Rank 2 exits after step 25; the checkpoint of step 20 holds every
    rank's part of the optimizer state, which the two survivors re-split
    and go on from."""
    ckpt = tmp_path / "run.ckpt"
    metrics = tmp_path / "m.jsonl"
    status = tmp_path / "status"
    common = [*MLP, "--data-cache", data_cache, "--global-batch", 48, "--steps", 40,
              "--timeout-s", 3, "--checkpoint", ckpt, "--checkpoint-every", 10]
    r = run(ddpx_run_cmd(3, *common, "--shard", "gradients", "--on-rank-loss", "shrink",
                         "--metrics", metrics, status_file=status),
            timeout=300, env=env(DDPX_TRAIN_FAIL_AT="25:2"))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert status.read_text().strip() == "ok, ranks lost: 2", out
    assert "going on with 2 rank(s) from step 20" in out, out
    assert [m["world"] for m in read_metrics(metrics) if m.get("event") == "shrink"] == [2]
    got, step = checkpoint_params(ckpt)
    # The reference: 3 ranks to step 20, then 2 (unsharded, through a checkpoint).
    ref = tmp_path / "ref.ckpt"
    plain = [*MLP, "--data-cache", data_cache, "--global-batch", 48, "--checkpoint", ref]
    assert run(mpirun_cmd(3, *plain, "--steps", 20)).returncode == 0
    r = run(mpirun_cmd(2, *plain, "--steps", 40, "--resume"))
    assert r.returncode == 0, r.stdout + r.stderr
    want, wstep = checkpoint_params(ref)
    assert step == wstep == 40
    for k in want:
        assert (got[k] - want[k]).abs().max() <= 1e-6, k


def test_clip_grad_norm_where_the_trainer_or_gradsync_steps(tmp_path, data_cache):
    """--clip-grad-norm: clip_grad_norm_ before the trainer's step, or
    GradSyncOptions::clip_grad_norm where GradSync steps (bit for bit: its
    own code on the whole averages; sharded: over every rank's parts, within
    rounding); a limit low enough to clip."""
    clip = ["--batch-size", 32, "--clip-grad-norm", 0.05]
    want, out = train(tmp_path, data_cache, 2, "trainer", *clip, steps=10)
    assert "gradient norm clipped to 0.05" in out, out
    w, _ = checkpoint_params(want)
    unclipped, _ = checkpoint_params(train(tmp_path, data_cache, 2, "off", "--batch-size", 32,
                                           steps=10)[0])
    assert any(not torch.equal(w[k], unclipped[k]) for k in w), "the limit never clipped"
    for name, extra, tol in (("gradsync", ["--overlap", "optimizer"], 0.0),
                             ("zero2", ["--shard", "gradients"], 1e-6)):
        g, _ = checkpoint_params(train(tmp_path, data_cache, 2, name, *clip, *extra, steps=10)[0])
        for k in w:
            assert (g[k] - w[k]).abs().max() <= tol, (name, k)


@pytest.mark.parametrize("extra, message", [
    (["--codec", "topk:0.01"], "--shard: optimizer does not combine with --codec topk:0.01"),
    (["--staleness", 1], "--shard: optimizer does not combine with --staleness 1"),
    (["--clip-grad-norm", 1, "--staleness", 1],
     "--clip-grad-norm: does not combine with --staleness 1"),
    (["--on-rank-loss", "shrink", "--global-batch", 8],
     "--shard: optimizer does not combine with --on-rank-loss shrink without --checkpoint"),
])
def test_bad_combinations_fail_before_any_rank_starts(data_cache, extra, message):
    r = run(mpirun_cmd(1, *MLP, "--data-cache", data_cache, "--steps", 1, "--shard", "optimizer",
                       *extra), timeout=120)
    assert r.returncode != 0 and message in r.stderr, r.stderr
