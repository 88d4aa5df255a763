"""Issue 46, part 2: a run that goes on at another world size from its
checkpoint, and a torchrun restart that resumes by itself.

With --global-batch the data position counts global batches, so a checkpoint
written by 2 ranks resumes at 3 (or 1) with the very global batch the
uninterrupted run would have taken next: the parameters then agree with the
uninterrupted run up to float32 summation order (a batch's gradient summed as
2 or 3 partial means; measured 3e-8 in the invariance test, bound 1e-6).
Another global batch is refused, naming both.

Under torchrun with --max-restarts, a worker that fails mid-run
(DDPX_TRAIN_FAIL_AT, the trainer's test hook, on the first start only) makes
torchrun restart the workers; with TORCHELASTIC_RESTART_COUNT > 0 ddpx-train
resumes from --checkpoint without --resume and ends where the uninterrupted
run does, bit for bit (same world size, codec none).
"""
import pytest
import torch

from trainer_util import checkpoint_params, env, model, mpirun_cmd, run, torchrun_cmd

COMMON = ["--global-batch", 12, "--lr", 0.05, "--lr-schedule", "constant", "--seed", 5,
          "--log-every", 4]


@pytest.mark.parametrize("name,first,then", [("lenet", 2, 3), ("han", 3, 1)])
def test_resume_at_another_world_size(tmp_path, data_cache, name, first, then):
    src = ["--data-cache", data_cache] if name == "lenet" else ["--train-samples", 600]
    common = ["--model", model(name), *src, *COMMON]
    straight = tmp_path / "straight.ckpt"
    r = run(mpirun_cmd(then, *common, "--steps", 16, "--checkpoint", straight))
    assert r.returncode == 0, r.stdout + r.stderr

    ckpt = tmp_path / "run.ckpt"
    r = run(mpirun_cmd(first, *common, "--steps", 8, "--checkpoint", ckpt))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(mpirun_cmd(then, *common, "--steps", 16, "--checkpoint", ckpt, "--resume"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"written by {first} rank(s); going on at {then}" in r.stdout, r.stdout
    assert f"resumed from {ckpt} at step 8" in r.stdout
    (got, gstep), (want, wstep) = checkpoint_params(ckpt), checkpoint_params(straight)
    assert gstep == wstep == 16
    assert got.keys() == want.keys()
    for k in want:
        assert (got[k] - want[k]).abs().max() <= 1e-6, (k, (got[k] - want[k]).abs().max())


def test_another_global_batch_is_refused(tmp_path, data_cache):
    common = ["--model", model("lenet"), "--data-cache", data_cache, "--seed", 5]
    ckpt = tmp_path / "run.ckpt"
    r = run(mpirun_cmd(2, *common, "--global-batch", 12, "--steps", 4, "--checkpoint", ckpt))
    assert r.returncode == 0, r.stdout + r.stderr
    # 3 x 4 = 12 samples a step: the same global batch, accepted.
    r = run(mpirun_cmd(3, *common, "--batch-size", 4, "--steps", 6, "--checkpoint", ckpt,
                       "--resume"))
    assert r.returncode == 0, r.stdout + r.stderr
    # 3 x 5 = 15: refused, naming both and what to pass.
    r = run(mpirun_cmd(3, *common, "--batch-size", 5, "--steps", 8, "--checkpoint", ckpt,
                       "--resume"))
    assert r.returncode != 0
    assert ("written by 3 rank(s) taking 12 samples a step, this run takes 15 over 3 rank(s); "
            "resume with the same global batch (--global-batch 12)") in r.stderr, r.stderr


def test_torchrun_restart_resumes_by_itself(tmp_path, data_cache):
    common = ["--model", model("lenet"), "--data-cache", data_cache, *COMMON, "--steps", 12,
              "--checkpoint-every", 3]
    straight = tmp_path / "straight.ckpt"
    r = run(torchrun_cmd(2, *common, "--checkpoint", straight))
    assert r.returncode == 0, r.stdout + r.stderr

    ckpt = tmp_path / "run.ckpt"
    cmd = torchrun_cmd(2, *common, "--checkpoint", ckpt)
    cmd.insert(cmd.index("--no-python"), "--max-restarts=1")
    # Rank 1 fails after step 7; the checkpoint of step 6 is the newest.
    r = run(cmd, env=env(DDPX_TRAIN_FAIL_AT="7:1"))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "rank 1 exits after step 7" in out
    assert "torchrun restart 1 with 2 rank(s): resuming from" in out, out
    assert f"resumed from {ckpt} at step 6" in out, out
    (got, gstep), (want, wstep) = checkpoint_params(ckpt), checkpoint_params(straight)
    assert gstep == wstep == 12
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # Without a restart (first start) an existing checkpoint is still refused.
    r = run(torchrun_cmd(2, *common, "--checkpoint", ckpt))
    assert r.returncode != 0 and "already exists; pass --resume" in r.stderr + r.stdout
