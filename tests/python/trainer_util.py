"""Helpers for the ddpx-train tests: launching under mpirun / torchrun,
finding a rank's process, reading checkpoints and metrics."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

TRAIN = os.environ.get("DDPX_TRAIN", "ddpx-train")
MODELS = Path(os.environ.get("DDPX_MODELS_DIR", "build/torchscript_models"))
MPIRUN = [os.environ.get("DDPX_MPIEXEC", "mpirun"), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
          "--mca", "btl_vader_single_copy_mechanism", "none"]


def model(name):
    return str(MODELS / f"{name}.pt")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra):
    e = dict(os.environ)
    e.setdefault("DDPX_TIMEOUT_S", "60")
    e["OMP_NUM_THREADS"] = "1"
    e.update({k: str(v) for k, v in extra.items()})
    return e


def mpirun_cmd(np, *args):
    return MPIRUN + ["-np", str(np), TRAIN, *map(str, args)]


# ddpx-run beside ddpx-train (plugin/trainer/ddpx-run), with MPIRUN's flags.
RUN = str(Path(TRAIN).with_name("ddpx-run")) if os.sep in TRAIN else "ddpx-run"


def ddpx_run_cmd(np, *args, status_file=None):
    extra = [f"--mpirun-arg={a}" for a in MPIRUN[1:]
             if a not in ("--allow-run-as-root", "--oversubscribe")]
    status = ["--status-file", str(status_file)] if status_file else []
    return [sys.executable, RUN, "-np", str(np), *extra, *status, "--", *map(str, args)]


def torchrun_cmd(np, *args, port=None):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(np),
            "--master-port", str(port or free_port()), "--no-python", TRAIN, *map(str, args)]


def run(cmd, timeout=600, **kw):
    """Runs to completion; returns CompletedProcess with text output."""
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          env=kw.pop("env", env()), **kw)


def start(cmd, **kw):
    return subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=kw.pop("env", env()), start_new_session=True, **kw)


def rank_pid(marker, rank, rank_var):
    """The pid of the ddpx-train process whose command line holds `marker`
    and whose environment has rank_var=rank (OMPI_COMM_WORLD_RANK or RANK)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            if not cmdline or not cmdline[0].endswith(b"ddpx-train") or marker.encode() not in cmdline:
                continue
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{rank_var}={rank}".encode() in environ:
            return int(proc.name)
    return None


def read_until(p, lines, text, timeout, what="training to start"):
    """Appends p's output lines to `lines` until one holds `text`, or the
    output ends (then p has exited: the caller's check says so). No pause
    between lines: wait_for's 50 ms per line let a fast job (HAN, 12 ms a
    step) run ~0.6 s ahead of the reader, and a 50-step run had ended before
    its step-15 line was read, so the rank was signalled too late."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        lines.append(line)
        if text in line or (line == "" and p.poll() is not None):
            return
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_for(pred, timeout, what):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def kill_group(p):
    """Ends a launched job and everything it started, even stopped processes."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=30)


def read_metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def checkpoint_tensors(path):
    """name -> tensor of a ddpx-train checkpoint (a TorchScript archive)."""
    import torch
    m = torch.jit.load(str(path))
    return dict(zip(m.model_names, m.model_tensors)), m.position.tolist()


def signal_rank_mid_run(tmp_path, data_cache, steps, rank, sig, np=3, extra=()):
    """Starts MLP --mode ps (async; 1 server + 2 workers unless `extra` says
    otherwise) on `np` ranks with DDPX_TIMEOUT_S 5, sends `sig` to `rank`
    once step 20 is logged, and waits for the job: (output, returncode,
    seconds from the signal, the metrics file, the status line). kill -9
    runs under ddpx-run (mpirun in recovery mode, the exit code from the
    status file), SIGSTOP under plain mpirun with --status-file."""
    marker = str(tmp_path / "marker")  # the metrics file; also finds this run's ranks
    status_file = tmp_path / "status"
    args = ["--mode", "ps", "--model", model("mlp"), "--data-cache", data_cache, "--steps", steps,
            "--batch-size", 16, "--log-every", 20, "--metrics", marker, *extra]
    if sig == signal.SIGKILL:
        cmd = ddpx_run_cmd(np, *args, status_file=status_file)
    else:
        cmd = mpirun_cmd(np, *args, "--status-file", status_file)
    p = start(cmd, env=env(DDPX_TIMEOUT_S=5))
    lines = []
    try:
        read_until(p, lines, "step 20/", 120)
        assert p.poll() is None, "".join(lines)
        pid = wait_for(lambda: rank_pid(marker, rank, "OMPI_COMM_WORLD_RANK"), 30,
                       f"rank {rank}'s pid")
        t0 = time.monotonic()
        os.kill(pid, sig)
        out, _ = p.communicate(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        kill_group(p)
    status = status_file.read_text().strip() if status_file.exists() else "(none)"
    return "".join(lines) + out, p.returncode, elapsed, marker, status


def ps_stop_and_resume(tmp_path, np_, common, between=None):
    """--mode ps, sync, int8 pushes (in `common`): 20 steps straight; then 12
    steps with checkpoints every 4, `between(ckpt, metrics)` (more checks on
    the saved state), and a --resume to 20. Asserts that the resume restored
    each worker's codec residuals and ended with the straight run's logged
    losses and test accuracy; returns (the resume's result, its end record)."""
    ref, ckpt, m = tmp_path / "ref.jsonl", tmp_path / "run.ckpt", tmp_path / "m.jsonl"
    r = run(mpirun_cmd(np_, *common, "--steps", 20, "--metrics", ref))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(mpirun_cmd(np_, *common, "--steps", 12, "--checkpoint", ckpt, "--checkpoint-every", 4,
                       "--metrics", m))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "run.ckpt.server0").exists()
    if between:
        between(ckpt, m)
    r = run(mpirun_cmd(np_, *common, "--steps", 20, "--checkpoint", ckpt, "--resume",
                       "--metrics", m))
    assert r.returncode == 0, r.stdout + r.stderr
    for w in (0, 1):
        assert f"worker {w} restored its codec residuals of step 12" in r.stdout, r.stdout
    want, got = read_metrics(ref), read_metrics(m)
    assert [x["loss"] for x in got if "event" not in x] == \
        [x["loss"] for x in want if "event" not in x]
    assert got[-1]["test_accuracy"] == want[-1]["test_accuracy"]
    return r, got[-1]


def checkpoint_params(path):
    """(name -> floating-point tensor, step) of a ddpx-train checkpoint."""
    tensors, (step, _, _) = checkpoint_tensors(path)
    return {k: v for k, v in tensors.items() if v.is_floating_point()}, step
