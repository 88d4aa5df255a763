"""ddpx-train on bad input: a clear error, a non-zero exit, no hang, and no
checkpoint overwritten or lost. Single process (no launcher) unless noted."""
import hashlib
import shutil

import pytest
import torch

from trainer_util import TRAIN, ddpx_run_cmd, env, model, mpirun_cmd, read_metrics, run


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A generated idx directory (ddpx-train writes it on first use)."""
    d = tmp_path_factory.mktemp("idx")
    r = run([TRAIN, "--model", model("mlp"), "--data-cache", d, "--steps", 1, "--quiet"])
    assert r.returncode == 0, r.stderr
    return d


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, data_dir):
    path = tmp_path_factory.mktemp("ckpt") / "good.ckpt"
    r = run([TRAIN, "--model", model("mlp"), "--data", data_dir, "--steps", 2, "--quiet",
             "--checkpoint", path])
    assert r.returncode == 0, r.stderr
    return path


def fails_with(args, *needles, cmd=None):
    r = run(cmd or [TRAIN, *map(str, args)], timeout=120)
    assert r.returncode != 0, r.stdout
    for n in needles:
        assert n in r.stderr, r.stderr
    return r


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_ddpx_run_exit_status_follows_the_job(tmp_path, data_dir):
    """ddpx-run runs mpirun in recovery mode, whose own exit code is 0
    whatever the ranks did, and exits with the outcome ddpx-train wrote to
    --status-file: 0 on "ok", non-zero on "failed: ...", naming why."""
    status = tmp_path / "status"
    status.write_text("ok\n")  # a stale outcome: ddpx-run must not believe it
    bad = tmp_path / "junk.pt"
    bad.write_bytes(b"this is not a TorchScript archive")
    r = run(ddpx_run_cmd(2, "--model", bad, "--steps", 1, status_file=status), timeout=300)
    assert r.returncode != 0, r.stdout + r.stderr
    line = status.read_text()
    assert line.startswith("failed: ") and "cannot load model" in line, line
    assert line.count("\n") == 1, line
    assert "ddpx-run: the job failed: failed: " in r.stderr, r.stderr
    r = run(ddpx_run_cmd(2, "--model", model("mlp"), "--data", data_dir, "--steps", 3, "--quiet",
                         status_file=status), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert status.read_text() == "ok\n"
    assert "ddpx-run: ok" in r.stderr, r.stderr


def test_missing_model():
    fails_with(["--model", "/nonexistent/model.pt", "--steps", 1], "/nonexistent/model.pt",
               "does not exist")


def test_not_torchscript(tmp_path):
    bad = tmp_path / "junk.pt"
    bad.write_bytes(b"this is not a TorchScript archive")
    fails_with(["--model", bad, "--steps", 1], "cannot load model", str(bad))


def test_model_without_forward(tmp_path):
    class NoForward(torch.nn.Module):
        @torch.jit.export
        def predict(self, x: torch.Tensor) -> torch.Tensor:
            return x

    path = tmp_path / "noforward.pt"
    torch.jit.script(NoForward()).save(str(path))
    fails_with(["--model", path, "--steps", 1], "has no forward() method")


def test_model_without_contract_attributes(tmp_path):
    path = tmp_path / "linear.pt"
    torch.jit.script(torch.nn.Linear(4, 2)).save(str(path))
    fails_with(["--model", path, "--steps", 1], "ddpx_input", "export_models.py")


def test_missing_data_directory():
    fails_with(["--model", model("mlp"), "--data", "/nonexistent/mnist", "--steps", 1],
               "/nonexistent/mnist")


def test_data_directory_without_files(tmp_path):
    fails_with(["--model", model("mlp"), "--data", tmp_path, "--steps", 1], "missing data file",
               "train-images-idx3-ubyte")


@pytest.mark.parametrize("damage", ["truncate", "magic", "label"])
def test_corrupt_idx_file(tmp_path, data_dir, damage):
    d = tmp_path / "idx"
    shutil.copytree(data_dir, d)
    if damage == "truncate":
        f = d / "train-images-idx3-ubyte"
        f.write_bytes(f.read_bytes()[:-1000])
        needles = ["corrupt idx file", "truncated"]
    elif damage == "magic":
        f = d / "t10k-labels-idx1-ubyte"
        b = bytearray(f.read_bytes())
        b[3] ^= 0xFF
        f.write_bytes(bytes(b))
        needles = ["corrupt idx file", "magic number"]
    else:
        f = d / "train-labels-idx1-ubyte"
        b = bytearray(f.read_bytes())
        b[8 + 17] = 42
        f.write_bytes(bytes(b))
        needles = ["label 42 at item 17 is not a class of model"]
    fails_with(["--model", model("mlp"), "--data", d, "--steps", 1], str(f), *needles)


def test_fresh_run_never_overwrites_a_checkpoint(tmp_path, data_dir, checkpoint):
    before = digest(checkpoint)
    fails_with(["--model", model("mlp"), "--data", data_dir, "--steps", 1, "--checkpoint",
                checkpoint], "already exists", "--resume")
    assert digest(checkpoint) == before


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_checkpoint_is_reported_and_kept(tmp_path, data_dir, checkpoint, damage):
    path = tmp_path / "bad.ckpt"
    good = checkpoint.read_bytes()
    path.write_bytes(b"\x00garbage" * 100 if damage == "garbage" else good[: len(good) // 2])
    before = digest(path)
    fails_with(["--model", model("mlp"), "--data", data_dir, "--steps", 3, "--checkpoint", path,
                "--resume"], "is corrupt, truncated", str(path))
    assert digest(path) == before


# An mlp checkpoint written with SGD, resumed by a run it does not fit: the
# error names what differs (the optimizer's before anything loads), and the
# file is kept.
@pytest.mark.parametrize("name, extra, needle", [
    ("lenet", [], "has no entry for"),
    ("mlp", ["--optimizer", "adam"], "written with --optimizer sgd, this run uses --optimizer adam"),
], ids=["another model", "another optimizer"])
def test_checkpoint_of_another_run(tmp_path, data_dir, checkpoint, name, extra, needle):
    path = tmp_path / "mlp.ckpt"
    shutil.copy(checkpoint, path)
    before = digest(path)
    fails_with(["--model", model(name), *extra, "--data", data_dir, "--steps", 3, "--checkpoint",
                path, "--resume"], "not this run's", needle)
    assert digest(path) == before


def test_corrupt_checkpoint_under_mpirun(tmp_path, data_dir):
    """Rank 0 reads the checkpoint; every rank must fail, none may hang."""
    path = tmp_path / "bad.ckpt"
    path.write_bytes(b"PK\x03\x04 not really a zip")
    fails_with(None, "is corrupt", cmd=mpirun_cmd(2, "--model", model("mlp"), "--data", data_dir,
                                                  "--steps", 3, "--checkpoint", path, "--resume"))


def test_usage_errors():
    r = run([TRAIN, "--help"])
    assert r.returncode == 0 and "--codec" in r.stdout and "--checkpoint-every" in r.stdout
    fails_with(["--model", model("mlp"), "--optimizer", "rmsprop"], "--optimizer")
    fails_with(["--model", model("mlp"), "--resume"], "--checkpoint")
    fails_with(["--model", model("mlp"), "--steps", 1, "--codec", "zstd"], "zstd")
    for bad in ("1", "x:5", "-1:5", "0:-2", "0:5ms"):
        fails_with(["--model", model("mlp"), "--straggler", bad], "--straggler wants RANK:MS")


def test_straggler_sleeps_every_step(tmp_path, data_dir):
    """--straggler (scripts/bench/ps's slow worker) really slows its rank: 8
    steps at 150 ms each cannot end in under 1.2 s; a rank not named is not
    slowed (same run otherwise, same result)."""
    out = {}
    for name, who in (("slow", "0:150"), ("other", "3:150")):
        m = tmp_path / f"{name}.jsonl"
        r = run([TRAIN, "--model", model("mlp"), "--data", data_dir, "--steps", 8, "--quiet",
                 "--straggler", who, "--metrics", m])
        assert r.returncode == 0, r.stderr
        out[name] = [x for x in read_metrics(m) if x.get("event") == "end"][0]
    assert out["slow"]["elapsed_s"] >= 8 * 0.150
    assert out["slow"]["loss"] == out["other"]["loss"]


@pytest.mark.parametrize("flags,needles", [
    (["--amp", "fp16", "--param-dtype", "bf16"], ["--amp", "--param-dtype bf16", "choose one"]),
    (["--amp", "fp16", "--mode", "ps"], ["--param-dtype", "--mode ps"]),
    (["--param-dtype", "bf16", "--staleness", "1"], ["--staleness", "--param-dtype"]),
    (["--param-dtype", "bf16", "--on-rank-loss", "shrink"], ["--on-rank-loss", "--param-dtype"]),
    (["--param-dtype", "fp64"], ["--param-dtype", "fp64"]),
])
def test_mixed_precision_combinations_are_named(data_dir, flags, needles):
    """Issue 63: a bad combination of --amp, --param-dtype and the rest names both."""
    fails_with(["--model", model("mlp"), "--data", data_dir, "--steps", 1, *flags], *needles)


def test_mixed_precision_checkpoints_resume_only_alike(data_dir, checkpoint, tmp_path):
    """A float32 run's checkpoint does not resume with bfloat16 parameters (the
    model's dtypes are named), nor one without loss scaling with it."""
    ckpt = tmp_path / "c.ckpt"
    shutil.copy(checkpoint, ckpt)
    fails_with(["--model", model("mlp"), "--data", data_dir, "--steps", 4, "--checkpoint", ckpt,
                "--resume", "--param-dtype", "bf16"], "Float there but [512, 784] BFloat16")
    fails_with(["--model", model("mlp"), "--data", data_dir, "--steps", 4, "--checkpoint", ckpt,
                "--resume", "--amp", "fp16"], "loss scaling off", "this run has it on")


def test_cudnn_benchmark_needs_cuda(data_dir):
    fails_with(["--model", model("mlp"), "--data", data_dir, "--steps", 1, "--cudnn-benchmark"],
               "--cudnn-benchmark", "needs --device cuda")


def test_parameter_server_refuses_cuda(data_dir):
    fails_with(["--model", model("mlp"), "--data", data_dir, "--steps", 1, "--mode", "ps",
                "--device", "cuda"], "--device", "CPU only")


def test_cuda_without_a_visible_gpu_is_named(data_dir):
    # CUDA_VISIBLE_DEVICES="" hides any GPU, on a machine with one too.
    r = run([TRAIN, "--model", model("mlp"), "--data", data_dir, "--steps", 1, "--device", "cuda"],
            timeout=120, env=env(CUDA_VISIBLE_DEVICES=""))
    assert r.returncode != 0, r.stdout
    assert "--device cuda, but no CUDA device is visible" in r.stderr, r.stderr
