#!/usr/bin/env python3
"""PyTorch's own distributed test suite against ddpx_mpi and, for comparison,
Gloo: pass / fail / skip counts per backend, and every test whose outcome
differs between them, with the reason.

Runs torch/testing/_internal/distributed/distributed_test.py's
`DistributedTest._DistTestBase` (shipped in the wheel) under
`mpirun -np N` (rank.py is one rank). A test that hangs or kills its job is
recorded as such ("hang", "crash") and the job is started again after it, so
one bad test cannot hide the rest.
"""
import argparse
import collections
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# Why a test cannot pass on an MPI-launched backend other than Gloo, however
# good: the test itself asks for Gloo (or for torch's own MPI build) by name.
# Checked against the skip message the suite gives (the decorators' text).
BY_NAME = [
    (re.compile(r"Only gloo backend supports timeouts"),
     "tests Gloo's own timeout messages; ddpx_mpi's timeouts have their own tests "
     "(test_mpi_timeout, test_mpi_wait_timeout)"),
    (re.compile(r"(?i)requires? (the )?gloo|gloo only|only gloo"),
     "written for Gloo by name"),
    (re.compile(r"(?i)mpi backend|BACKEND != .mpi|requires mpi"),
     "written for torch's built-in MPI backend by name (dist.Backend.MPI)"),
]


def list_tests(python):
    """Every test_* of _DistTestBase, in name order (the same for each backend)."""
    code = (
        "import os; os.environ.setdefault('BACKEND','gloo'); os.environ.setdefault('WORLD_SIZE','3');"
        "from torch.testing._internal.distributed.distributed_test import DistributedTest as D;"
        "print('\\n'.join(sorted(n for n in dir(D._DistTestBase) if n.startswith('test_'))))"
    )
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True)
    return out.stdout.split()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_logs(pattern, np_):
    """Per test: the outcomes of the ranks that finished it, and who started it."""
    started, ended = collections.defaultdict(set), collections.defaultdict(dict)
    order = []
    for r in range(np_):
        path = pattern.replace("{rank}", str(r))
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
                if ev["event"] == "start":
                    if ev["test"] not in started:
                        order.append(ev["test"])
                    started[ev["test"]].add(r)
                else:
                    ended[ev["test"]][r] = ev
    return order, started, ended


def combine(evs):
    """One outcome from every rank's: a failure anywhere fails the test."""
    outs = [e["outcome"] for e in evs.values()]
    for kind in ("fail", "pass", "skip"):
        hits = [e for e in evs.values() if e["outcome"] == kind]
        if kind == "fail" and hits:
            return "fail", "rank %d: %s" % (min(r for r, e in evs.items() if e["outcome"] == "fail"),
                                            hits[0]["detail"])
        if kind == "pass" and all(o == "pass" for o in outs):
            return "pass", ""
        if kind == "skip" and hits:
            return "skip", hits[0]["detail"]
    return "fail", "ranks disagree: " + ", ".join(sorted(set(outs)))


def run_backend(args, backend, tests, workdir):
    """Runs `tests` (in order) until each has an outcome; restarts after a
    test that hung or crashed its job."""
    results = {}
    remaining = list(tests)
    attempt = 0
    while remaining:
        attempt += 1
        job = os.path.join(workdir, f"{backend}.{attempt}")
        temp = os.path.join(job, "tmp")
        for d in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(temp, d))
        tests_file = os.path.join(job, "tests.txt")
        with open(tests_file, "w") as f:
            f.write("\n".join(remaining) + "\n")
        log = os.path.join(job, "rank{rank}.jsonl")
        env = dict(os.environ, TEMP_DIR=temp, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        env.pop("TORCH_DISTRIBUTED_DEBUG", None)
        real, _, gates = backend.partition("@")
        cmd = ["mpirun", "-np", str(args.np), "--oversubscribe", "--bind-to", "none",
               args.python, os.path.join(HERE, "rank.py"), "--backend", real,
               "--tests", tests_file, "--log", log, "--timeout-s", str(args.timeout_s)]
        if gates:
            cmd += ["--gates", gates]
        if args.lib:
            cmd += ["--lib", args.lib]
        with open(os.path.join(job, "output.txt"), "w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            last_change, last_size, hung = time.monotonic(), -1, False
            while proc.poll() is None:
                time.sleep(1)
                size = sum(os.path.getsize(log.replace("{rank}", str(r)))
                           for r in range(args.np) if os.path.exists(log.replace("{rank}", str(r))))
                if size != last_size:
                    last_change, last_size = time.monotonic(), size
                elif time.monotonic() - last_change > args.test_limit_s:
                    hung = True
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        order, started, ended = read_logs(log, args.np)
        done_upto = 0
        for i, name in enumerate(order):
            if len(ended[name]) == args.np:
                results[name] = combine(ended[name])
                done_upto = i + 1
                continue
            # This test stopped the job: name what it did, go on after it.
            results[name] = ("hang" if hung else "crash",
                             f"job {'killed after no progress for %ds' % args.test_limit_s if hung else 'exited %d' % proc.returncode}"
                             f" (log: {job}/output.txt)")
            done_upto = i + 1
            break
        if done_upto == 0 and remaining:
            # Not even the first test started: the job itself cannot run.
            with open(os.path.join(job, "output.txt")) as f:
                sys.exit(f"torch_suite: {backend}: the job did not start:\n{f.read()[-3000:]}")
        remaining = [t for t in remaining if t not in results]
        print(f"[{backend}] {len(results)}/{len(tests)} tests done ({attempt} jobs)", flush=True)
    return results


def reason_for(detail):
    for pattern, why in BY_NAME:
        if pattern.search(detail):
            return why
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="ddpx_mpi,gloo,ddpx_mpi@gloo",
                   help="comma list; the first two are compared test by test. X@gloo: "
                        "backend X, with the suite's backend-name checks decided as for Gloo "
                        "and every group it asks Gloo for made with X (its Gloo-only tests)")
    p.add_argument("--np", type=int, default=3)
    p.add_argument("-k", dest="pattern", default="", help="only tests whose name matches (regex)")
    p.add_argument("--timeout-s", type=float, default=120, help="process group timeout")
    p.add_argument("--test-limit-s", type=float, default=300,
                   help="kill a job whose logs have not moved for this long")
    p.add_argument("--out", default="bench_results/torch_suite", help="logs and summary.json")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--lib", default=os.environ.get("DDPX_LIB"))
    args = p.parse_args()

    tests = [t for t in list_tests(args.python) if re.search(args.pattern, t)]
    os.makedirs(args.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="jobs.", dir=args.out)
    backends = args.backends.split(",")
    results = {}
    for b in backends:
        t0 = time.monotonic()
        results[b] = run_backend(args, b, tests, workdir)
        print(f"[{b}] {time.monotonic() - t0:.0f} s", flush=True)

    print(f"\n{len(tests)} tests of _DistTestBase, mpirun -np {args.np}")
    print(f"{'backend':10} {'pass':>5} {'fail':>5} {'skip':>5} {'hang':>5} {'crash':>5}")
    for b in backends:
        c = collections.Counter(o for o, _ in results[b].values())
        print(f"{b:10} {c['pass']:5} {c['fail']:5} {c['skip']:5} {c['hang']:5} {c['crash']:5}")

    summary = {"np": args.np, "tests": len(tests), "results": results}
    peer = "gloo"
    ours = [b for b in backends if b != peer]
    if peer in backends and ours:
        # A test counts as passing on ours when it passes in any of our modes
        # (natively, or with the suite's name checks decided as for Gloo).
        def ours_pass(t):
            return any(results[b][t][0] == "pass" for b in ours)

        lost = [t for t in tests if results[peer][t][0] == "pass" and not ours_pass(t)]
        gained = [t for t in tests if results[peer][t][0] != "pass" and ours_pass(t)]
        print(f"\nPass on {peer} and in no mode of ours ({', '.join(ours)}): {len(lost)}")
        for t in lost:
            print(f"  {t}: " + "; ".join(f"{b} {results[b][t][0]}: {reason_for(results[b][t][1]) or results[b][t][1]}"
                                         for b in ours))
        print(f"Pass on ours and not on {peer}: {len(gained)}")
        for t in gained:
            print(f"  {t}: {peer} {results[peer][t][0]}: {results[peer][t][1][:200]}")
        summary["passes_on_peer_not_ours"] = lost
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"logs: {workdir}; summary: {os.path.join(args.out, 'summary.json')}")


if __name__ == "__main__":
    main()
