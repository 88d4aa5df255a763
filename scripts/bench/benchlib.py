"""Shared pieces of the Python benchmarks in scripts/bench/.

Every benchmark times ours and the peer in the same process, prints one table
with a `ratio` column (ours / peer time; < 1 means ours is faster), ends with a
line `geomean ratio: X`, and writes bench_results/<name>.json (git-ignored; or
$DDPX_BENCH_OUT/<name>.json) with the command, date, torch, CUDA and card.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def exit_if_dry():
    """DDPX_BENCH_DRY=1: the arguments were parsed and checked; run nothing (a
    rehearsal of scripts/device/check.sh on a machine without the device)."""
    if os.environ.get("DDPX_BENCH_DRY") == "1":
        print(f"{Path(sys.argv[0]).name}: arguments ok (DDPX_BENCH_DRY=1: not run)")
        sys.exit(0)


class _Parser(argparse.ArgumentParser):
    def parse_args(self, *args, **kwargs):
        parsed = super().parse_args(*args, **kwargs)
        exit_if_dry()
        return parsed


def parser(description):
    p = _Parser(description=description)
    p.add_argument("--quick", action="store_true", help="a smaller suite that ends within a minute")
    p.add_argument("--repeat", type=int, default=None, help="timed repetitions per case")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for both sides")
    return p


def steady_heap():
    """Re-runs this benchmark (once) with glibc's malloc thresholds pinned, so
    that both sides allocate from a warm heap, as in a training loop's steady
    state. Left dynamic, glibc serves a large tensor with fresh mmap'd pages
    (or trims the heap after it) until some earlier, larger free has raised
    its thresholds: the page faults then cost more than the convolution
    itself, and a case's times depended on the cases run before it
    (F.conv2d of 3x3 depthwise c32 at batch 8: forward 0.48 ms after the
    seed's 2048x2048 cases, 2.3-3.0 ms run alone)."""
    import sys

    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2**31 - 1)
    os.environ["MALLOC_TRIM_THRESHOLD_"] = str(2**32 - 1)
    os.execv(sys.executable, [sys.executable] + sys.argv)


def load_plugin():
    import torch  # here, so that launchers (ShapedLink) run on a python without torch

    lib = os.environ.get("DDPX_LIB", str(ROOT / "build" / "libddpx.so"))
    torch.ops.load_library(lib)
    return lib


def time_fn(fn, repeat, warmup=2):
    """Median wall time of fn() in seconds over `repeat` runs after `warmup`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(fn_ours, fn_peer, repeat, warmup=2):
    """Median times of two functions, alternated so drift hits both alike; which
    one goes first alternates too, so neither always inherits the other's
    caches and thread-pool state."""
    for _ in range(warmup):
        fn_ours()
        fn_peer()
    fns, times = (fn_ours, fn_peer), ([], [])
    for i in range(repeat):
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def cuda_interleaved(fn_ours, fn_peer, calls, rounds=7, warmup=2):
    """CUDA: median per-call times (s) of two functions, each round timed with
    device events around `calls` back-to-back calls (no host sync between
    them: a sync per call would add its own ~10 us to kernels that short),
    the two alternating which goes first, as interleaved()."""
    import torch

    for _ in range(warmup):
        fn_ours()
        fn_peer()
    torch.cuda.synchronize()
    fns, times = (fn_ours, fn_peer), ([], [])
    for i in range(rounds):
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fns[k]()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times[0]), statistics.median(times[1])


def cuda_graph_interleaved(fn_ours, fn_peer, calls, rounds=7, warmup=2):
    """As cuda_interleaved, but each side's `calls` back-to-back calls are
    captured once into a CUDA graph and the rounds time its replays: the
    kernels and the gaps between them without the host's share (Python, the
    dispatcher, autograd), the same cache state on both sides. Per-call
    times (s)."""
    import torch

    graphs = []
    for fn in (fn_ours, fn_peer):
        side = torch.cuda.Stream()  # (warm-up off the default stream, as capture wants)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graphs.append(graph)
    ours, peer = cuda_interleaved(graphs[0].replay, graphs[1].replay, 1, rounds=rounds, warmup=1)
    return ours / calls, peer / calls


def cuda_copy_bandwidth(nbytes=1 << 30):
    """Bytes read plus written per second of a large device-to-device copy
    (METHOD.md's memory-bandwidth ceiling), median of 5."""
    import torch

    a = torch.empty(nbytes // 4, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    t = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        t.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(t)


class Rows(list):
    """A benchmark's rows, each printed as it is measured ("# row" and its
    JSON): a run cut short by a time limit (scripts/device/check.sh's steps,
    which bring back the log) still shows the cases it finished. `left_out`:
    cases not run for want of time (each_case)."""

    left_out = 0

    def append(self, row):
        super().append(row)
        print("# row " + json.dumps(row, default=str), flush=True)


def out_of_time(margin_s=20.0):
    """Whether the device check's step ends within `margin_s` seconds
    (DDPX_STEP_DEADLINE, seconds since the epoch, set by
    scripts/device/check.sh): a benchmark then takes no more cases and
    reports those it has, rather than be killed with no JSON written."""
    deadline = os.environ.get("DDPX_STEP_DEADLINE")
    return deadline is not None and time.time() > float(deadline) - margin_s


def each_case(cases, measure, label, cuda=False):
    """Rows of measure(case) for each case, in order. A case that raises is a
    row of its own with the error (unrated), and the next case runs; on CUDA,
    an error the device keeps (the next synchronize raises too) ends the
    loop. Out of the step's time (out_of_time), the remaining cases are left
    out and counted (Rows.left_out)."""
    cases = list(cases)
    rows = Rows()
    for i, case in enumerate(cases):
        if out_of_time():
            rows.left_out = len(cases) - i
            print(f"# out of the step's time: {rows.left_out} case(s) left out", flush=True)
            break
        try:
            rows.append(measure(case))
        except Exception as e:  # noqa: BLE001  (a failing case is a result)
            first = (str(e).splitlines() or [""])[0]
            print(f"# {label(case)}: FAILED: {type(e).__name__}: {e}", flush=True)
            rows.append({"case": label(case), "error": f"{type(e).__name__}: {first}"})
            if cuda:
                import torch
                try:
                    torch.cuda.synchronize()
                except Exception as e2:  # noqa: BLE001
                    rows.left_out = len(cases) - i - 1
                    print(f"# the device keeps the error ({e2}): {rows.left_out} case(s) "
                          "left out", flush=True)
                    break
    return rows


def _json_safe(v):
    """NaN and infinities as null (strict JSON readers reject them)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def geomean(values):
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _summary(rows, key):
    """(geomean, worst row) of column `key` over the rows that have it."""
    rated = [r for r in rows if r.get(key) is not None]
    return geomean([r[key] for r in rated]), max(rated, key=lambda r: r[key], default=None)


def print_table(columns, rows):
    """Rows (dicts) as right-aligned columns under their names; "-" where a
    row lacks one."""
    widths = {c: max([len(c)] + [len(_fmt(r.get(c))) for r in rows]) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def proc_status_bytes(field, pid="self"):
    """A memory field of /proc/<pid>/status in bytes: VmRSS (resident now),
    VmHWM (resident at its peak: ru_maxrss), ... (the kernel writes kB)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"/proc/{pid}/status has no {field}")


def report(name, columns, rows, ratio_key="ratio", extra=None, also=()):
    """Print rows (dicts) as a table, then the worst case and the geomean of
    each ratio column in `also` and last of `ratio_key`; save JSON."""
    if any("error" in r for r in rows) and "error" not in columns:
        columns = [*columns, "error"]  # (failed cases: each_case)
    print_table(columns, rows)
    summary = {}
    for key in (*also, ratio_key):
        g, worst = _summary(rows, key)
        summary[key] = {"geomean": g, "worst": worst[key] if worst else None,
                        "worst_case": worst.get(columns[0]) if worst else None}
        label = "ratio" if key == ratio_key else key
        if worst:  # the case a user loses most on, named (the first column)
            print(f"worst {label}: {worst[key]:.3f} ({_fmt(worst.get(columns[0]))})")
        print(f"geomean {label}: {g:.3f}")
    # DDPX_BENCH_OUT: another folder (scripts/device/check.sh: its OUT_DIR).
    out = Path(os.environ.get("DDPX_BENCH_OUT", ROOT / "bench_results"))
    out.mkdir(parents=True, exist_ok=True)
    left_out = getattr(rows, "left_out", 0)
    if left_out:
        print(f"# {left_out} case(s) left out: out of the step's time or after a device error")
    with open(out / f"{name}.json", "w") as f:
        json.dump(_json_safe({"name": name, "rows": rows,
                              "geomean_ratio": summary[ratio_key]["geomean"],
                              "worst_ratio": summary[ratio_key]["worst"], "summary": summary,
                              "cases_left_out": left_out, **_provenance(), **(extra or {})}),
                  f, indent=1, default=str)
    return summary[ratio_key]["geomean"]


def _provenance():
    """What a result file must say of where it came from."""
    import datetime
    import platform

    import torch
    gpu = torch.cuda.is_available()
    return {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "card": torch.cuda.get_device_name() if gpu else None,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e3 else f"{v:.0f}"  # (1234, not 1.23e+03)
    return str(v)


def build_exe(name):
    """Path of the executable `name` the build made (DDPX_BUILD, else build/,
    else PATH); exits naming the target to build when there is none."""
    import shutil

    exe = Path(os.environ.get("DDPX_BUILD", ROOT / "build")) / name
    if not exe.exists():
        exe = Path(shutil.which(name) or exe)
    if not exe.exists():
        sys.exit(f"{name} is not built (ninja -C build {name})")
    return str(exe)


def rate_bytes(rate):
    """tc's rate text ("1gbit", "100mbit", "10gbit") in bytes per second."""
    import re

    m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", rate.lower())
    if not m:
        raise ValueError(f"not a tc rate in bits: {rate!r}")
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]] / 8


def link_text(rate="1gbit"):
    return f"emulated {rate} link (netns loopback, tc tbf rate {rate} burst 256kb latency 50ms)"


class ShapedLink:
    """A network namespace whose loopback is shaped to `rate` (tc tbf; 1 Gbit/s
    unless told), for ranks on one machine: `prefix` runs a command inside it. Both directions
    share the one shaped device. The namespace is deleted on exit, on SIGINT/
    SIGTERM/SIGHUP and at interpreter exit. Without CAP_NET_ADMIN (or with
    enabled=False) `prefix` is empty and `link` says the loopback is unshaped.

        with benchlib.ShapedLink("ddpx-bench-ddp") as net:
            subprocess.run(net.prefix + ["mpirun", ...])
    """

    def __init__(self, name, enabled=True, rate="1gbit", why_not="--no-netns"):
        self.ns = f"{name}-{os.getpid()}"
        self.enabled = enabled
        self.rate = rate
        self.made = False
        self.prefix = []
        self.link = f"UNSHAPED plain loopback ({why_not})"

    def __enter__(self):
        import atexit
        import signal
        import subprocess
        import sys

        if not self.enabled:
            return self
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda s, f: (self.close(), sys.exit(128 + s)))
        ip = ["ip", "netns", "exec", self.ns]
        try:
            subprocess.run(["ip", "netns", "add", self.ns], check=True, capture_output=True, text=True)
            self.made = True
            for cmd in (["ip", "-n", self.ns, "link", "set", "lo", "up"],
                        ip + ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", self.rate,
                              "burst", "256kb", "latency", "50ms"]):
                subprocess.run(cmd, check=True, capture_output=True, text=True)
            self.prefix = ip
            self.link = link_text(self.rate)
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            self.close()
            err = e.stderr.strip() if getattr(e, "stderr", None) else str(e)
            self.link = f"UNSHAPED plain loopback (no network namespace: {err})"
            print(f"cannot shape a link ({err}); falling back to plain loopback", file=sys.stderr)
        return self

    def close(self):
        import subprocess

        if self.made:
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
            self.made = False

    def __exit__(self, *exc):
        self.close()


def mpirun_tcp_loopback(np_=2):
    """mpirun for ranks on this machine that talk TCP over loopback only (so
    that a ShapedLink shapes MPI too)."""
    import shutil

    return [shutil.which("mpirun") or "mpirun", "--allow-run-as-root", "--oversubscribe",
            "-np", str(np_), "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
            "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo"]


def trainer_env():
    """Environment of ddpx-train under mpirun as root, one intra-op thread."""
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                OMP_NUM_THREADS="1")


def ddpx_train(np_, model, steps, extra, prefix=(), log_every=10, batch=32):
    """Runs ddpx-train on np_ ranks (MPI over TCP loopback, so a ShapedLink
    shapes it; `prefix` runs it inside one) on build/torchscript_models/<model>.pt;
    returns (the progress records, the end record) of its --metrics. batch
    None: no --batch-size (extra says --global-batch)."""
    import subprocess
    import tempfile

    build = Path(os.environ.get("DDPX_BUILD", ROOT / "build"))
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        cmd = list(prefix) + mpirun_tcp_loopback(np_) + ["--bind-to", "none"] + [
            str(build / "ddpx-train"), "--model", str(build / "torchscript_models" / f"{model}.pt"),
            "--steps", str(steps), *(["--batch-size", str(batch)] if batch else []), "--threads", "1",
            "--log-every", str(log_every), "--quiet", "--metrics", str(metrics),
            *map(str, extra)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=trainer_env())
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    return [m for m in lines if "event" not in m], next(m for m in lines if m.get("event") == "end")
