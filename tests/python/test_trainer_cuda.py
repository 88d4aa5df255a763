"""ddpx-train --device cuda (label gpu): LeNet, HAN and the transformer train on
the GPU to the accuracy the same flags reach on the CPU, under mpirun (two
ranks sharing the one GPU: ddpx_mpi stages CUDA tensors through host memory)
and torchrun (one rank: NCCL, since one GPU cannot hold two NCCL ranks), with
--amp bf16 and --cudnn-benchmark too; a checkpoint written on the GPU resumes
on the CPU; HAN's GRUs find their weights flat on cuDNN (no compaction
warned about on every call). Mixed precision (issue 63): --amp fp16 (CUDA autocast to float16
and loss scaling) within 1 point of the same float32 run on the GPU (HAN: 3),
and --param-dtype bf16 --reduce-dtype fp32 within 3.

Tolerance: test accuracy within 3 points of the CPU run's (the GPU sums in
other orders, so the runs are not bitwise alike; seen on the CPU: LeNet 9x%).
"""
import pytest

from conftest import needs_cuda
from trainer_util import model, mpirun_cmd, read_metrics, run, torchrun_cmd

pytestmark = needs_cuda
CASES = {
    "lenet": ["--steps", 200, "--batch-size", 32, "--lr", 0.05],
    "han": ["--train-samples", 4000, "--steps", 200, "--batch-size", 32, "--optimizer", "adam",
            "--lr", 1e-2],
    "transformer": ["--train-samples", 2000, "--steps", 150, "--batch-size", 16, "--lr", 0.05],
}


def train(tmp_path, tag, cmd):
    metrics = tmp_path / f"{tag}.jsonl"
    r = run(cmd + ["--metrics", metrics, "--log-every", 50])
    assert r.returncode == 0, r.stdout + r.stderr
    # HAN's GRUs on cuDNN: their weights flat when moved to the GPU, and the
    # per-call casts of --amp fp16 not warned about (a line per call)
    assert "single contiguous chunk" not in r.stderr, r.stderr[-3000:]
    lines = read_metrics(metrics)
    return r.stdout, [m for m in lines if "event" not in m], lines[-1]


_CPU_RUNS = {}


def on_cpu(tmp_path, args):
    """The end metrics of the 2-rank CPU run a GPU run is held to: trained
    once per argument list in this module (three tests hold LeNet to the same
    run; the device's minutes are few)."""
    key = tuple(map(str, args))
    if key not in _CPU_RUNS:
        _CPU_RUNS[key] = train(tmp_path, "cpu", mpirun_cmd(2, *args))[2]
    return _CPU_RUNS[key]


@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_matches_cpu_accuracy_under_mpirun(tmp_path, data_cache, name):
    args = ["--model", model(name), "--data-cache", data_cache, *CASES[name]]
    cpu = on_cpu(tmp_path, args)
    out, steps, gpu = train(tmp_path, "gpu", mpirun_cmd(2, *args, "--device", "cuda"))
    assert "over ddpx_mpi on cuda" in out, out
    assert steps[-1]["loss"] < steps[0]["loss"], steps
    assert abs(gpu["test_accuracy"] - cpu["test_accuracy"]) <= 0.03, (gpu, cpu)


def test_cuda_bf16_autocast_trains(tmp_path, data_cache):
    # (The rate decaying to 0, as the CPU tests of --amp: at a constant rate
    # LeNet's accuracy moves by 1-2 points between runs, bfloat16 aside.)
    args = ["--model", model("lenet"), "--data-cache", data_cache, *CASES["lenet"],
            "--lr-schedule", "cosine"]
    cpu = on_cpu(tmp_path, args)
    out, _, amp = train(tmp_path, "amp", mpirun_cmd(2, *args, "--device", "cuda", "--amp", "bf16"))
    assert "on cuda (autocast bf16)" in out, out
    assert abs(amp["test_accuracy"] - cpu["test_accuracy"]) <= 0.03, (amp, cpu)


def test_cuda_cudnn_benchmark_trains(tmp_path, data_cache):
    # cuDNN's algorithms and tiled_conv2d's path (cuDNN or ours) measured per
    # shape on the first steps (LeNet's convolutions are ddpx::tiled_conv2d).
    args = ["--model", model("lenet"), "--data-cache", data_cache, *CASES["lenet"]]
    cpu = on_cpu(tmp_path, args)
    out, _, gpu = train(tmp_path, "bench", mpirun_cmd(2, *args, "--device", "cuda",
                                                      "--cudnn-benchmark"))
    assert "on cuda (cudnn benchmark)" in out, out
    assert abs(gpu["test_accuracy"] - cpu["test_accuracy"]) <= 0.03, (gpu, cpu)


def test_torchrun_one_rank_over_nccl(tmp_path, data_cache):
    # One rank sees half the samples of the two-rank runs in as many steps.
    # At a constant rate its test accuracy swung by 11 points between the CPU
    # and the GPU run at 200 steps (0.86 and 0.74 on the H100, 2026-11-27) and
    # still by 11 at 400 (0.83 and 0.94 on the H200, 2026-11-30): the rate
    # decays to 0 here, as in the --amp tests, so that both runs settle.
    lenet = [a for a in CASES["lenet"] if a not in ("--steps", 200)]
    args = ["--model", model("lenet"), "--data-cache", data_cache, *lenet, "--steps", 400,
            "--lr-schedule", "cosine"]
    _, _, cpu = train(tmp_path, "cpu", torchrun_cmd(1, *args))
    out, steps, gpu = train(tmp_path, "gpu", torchrun_cmd(1, *args, "--device", "cuda"))
    assert "on cuda" in out, out
    assert steps[-1]["loss"] < steps[0]["loss"], steps
    assert abs(gpu["test_accuracy"] - cpu["test_accuracy"]) <= 0.03, (gpu, cpu)


def test_gpu_checkpoint_resumes_on_the_cpu(tmp_path, data_cache):
    ckpt = tmp_path / "ck.pt"
    args = ["--model", model("lenet"), "--data-cache", data_cache, "--batch-size", 32,
            "--lr", 0.05, "--checkpoint", ckpt, "--optimizer", "adam"]
    r = run(mpirun_cmd(2, *args, "--steps", 40, "--device", "cuda"))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(mpirun_cmd(2, *args, "--steps", 80, "--resume"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout and "at step 40" in r.stdout, r.stdout


@pytest.mark.parametrize("name", ["lenet", "han"])
def test_cuda_fp16_amp_and_bf16_parameters_train(tmp_path, data_cache, name):
    # Trained to where accuracy settles (the rate decaying to 0), as the CPU
    # test of --amp fp16 (test_trainer_train.py).
    src = (["--data-cache", data_cache, "--lr", 0.05, "--seed", 7] if name == "lenet" else
           ["--train-samples", 4000, "--optimizer", "adam", "--lr", 1e-2, "--seed", 1])
    args = ["--model", model(name), *src, "--batch-size", 32, "--steps", 300,
            "--lr-schedule", "cosine", "--device", "cuda"]
    _, _, fp32 = train(tmp_path, "fp32", mpirun_cmd(2, *args))
    out, steps, fp16 = train(tmp_path, "fp16", mpirun_cmd(2, *args, "--amp", "fp16"))
    assert "on cuda (autocast fp16, loss scaling)" in out, out
    assert all("amp_scale" in m for m in steps), steps
    # (LeNet within 1 point; HAN within 3: its test set is 400 documents, 4 a
    # point, and on the GPU its whole recurrence runs in float16, where the
    # CPU test's kept float32.)
    close = 0.01 if name == "lenet" else 0.03
    assert abs(fp16["test_accuracy"] - fp32["test_accuracy"]) <= close, (fp16, fp32)
    out, _, bf16 = train(tmp_path, "bf16", mpirun_cmd(2, *args, "--param-dtype", "bf16",
                                                      "--reduce-dtype", "fp32"))
    assert "bf16 parameters, fp32 masters, reduced in fp32" in out, out
    assert abs(bf16["test_accuracy"] - fp32["test_accuracy"]) <= 0.03, (bf16, fp32)
