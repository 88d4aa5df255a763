#!/usr/bin/env python3
"""Summarise and plot a GradSync trace (DDPX_TRACE=path / GradSyncOptions().trace(path)).

    scripts/trace_report.py TRACE.json [--steps a:b] [--png out.png] [--plot-steps N]

Prints the same per-step medians as GradSync::profile_summary(), one column
per rank, computed from the trace's spans (backward, final callback, bucket
runs, hooks) and its per-step "ddpx::step_stats" records (bytes, re-plans,
mispredictions). With --png, draws a per-rank timeline of the first
--plot-steps traced steps (step track, hooks, one track per channel with
encode / wire / decode, and sharded buckets' gathers) above a stacked bar
per rank of where a median step's time goes. The trace format (tracks, events) is described in hooks/profiler.h.
"""
import argparse
import json
import statistics
import sys
from collections import defaultdict


def parse_steps(text):
    a, sep, b = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"--steps must be a:b, a: or :b, got {text!r}")
    try:
        lo = int(a) if a else 1
        hi = int(b) if b else sys.maxsize
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps must be integers a:b, got {text!r}") from None
    if lo > hi:
        raise argparse.ArgumentTypeError(f"--steps {text!r} is empty")
    return lo, hi


def load(path, steps=None):
    """{rank: {step: [events]}} of the trace's non-metadata events."""
    with open(path) as f:
        doc = json.load(f)
    if "traceEvents" not in doc:
        raise SystemExit(f"{path}: not a Chrome trace (no traceEvents)")
    out = defaultdict(lambda: defaultdict(list))
    for e in doc["traceEvents"]:
        if e.get("ph") == "M" or "step" not in e.get("args", {}):
            continue
        step = int(e["args"]["step"])
        if steps and not steps[0] <= step <= steps[1]:
            continue
        out[e["pid"]][step].append(e)
    if not out:
        raise SystemExit(f"{path}: no ddpx GradSync steps in the trace" + (" window" if steps else ""))
    return out


def step_figures(events):
    """One step's figures (microseconds), as GradSync's step record has them."""
    by = defaultdict(list)
    for e in events:
        by[e["name"]].append(e)
    stats = by["ddpx::step_stats"][0]["args"] if by["ddpx::step_stats"] else {}
    runs = [e for e in events if e["name"].startswith("ddpx::allreduce[")]
    hooks = [e for e in events if e["name"].startswith("ddpx::hooks[")]
    fc = by["ddpx::final_callback"][0]["dur"]
    # Communication: wall time with at least one bucket in flight (launch ->
    # complete), as GradSync::profile() counts it.
    comm, covered = 0.0, float("-inf")
    for launch, complete in sorted((e["args"]["launch"], e["args"]["complete"]) for e in runs):
        if complete > covered:
            comm += complete - max(launch, covered)
            covered = complete
    calls = sum(e["args"]["calls"] for e in hooks)
    f = {
        "backward_us": by["ddpx::backward"][0]["dur"],
        "comm_us": comm,
        "exposed_us": fc,
        "efficiency": 1 - fc / comm if comm > 0 else None,
        "hook_cpu_us": stats.get("hook_cpu_us"),
        "hook_cpu_per_param_us": sum(e["args"]["cpu_us"] for e in hooks) / calls if calls else None,
        "bytes_sent": stats.get("bytes_sent"),
        "compression": (stats["bytes_raw"] / stats["bytes_sent"]) if stats.get("bytes_sent") else None,
        "replans": stats.get("replans", 0),
        "mispredictions": stats.get("unused_mispredictions", 0),
        "final_wait_us": by["ddpx::final_wait"][0]["dur"] if by["ddpx::final_wait"] else 0,
        "write_back_us": by["ddpx::write_back"][0]["dur"] if by["ddpx::write_back"] else 0,
        "hooks_only_us": sum(e["args"]["cpu_us"] for e in hooks),
        "params": stats.get("params"),
    }
    # Trainer phases (GradSync::phase): every other span on the step track.
    known = {"ddpx::backward", "ddpx::final_callback", "ddpx::final_wait", "ddpx::write_back"}
    f["phases"] = {e["name"][len("ddpx::"):]: e["dur"] for e in events
                   if e.get("tid") == 0 and e.get("ph") == "X" and e["name"] not in known}
    return f


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


ROWS = [  # (label, key, scale, unit)
    ("compute (backward)", "backward_us", 1e-3, "ms"),
    ("communication", "comm_us", 1e-3, "ms"),
    ("exposed communication", "exposed_us", 1e-3, "ms"),
    ("overlap efficiency", "efficiency", 100.0, "%"),
    ("hook CPU, total", "hook_cpu_us", 1e-3, "ms"),
    ("hook CPU per parameter tensor", "hook_cpu_per_param_us", 1.0, "us"),
    ("bytes sent", "bytes_sent", 1e-6, "MB"),
    ("compression ratio", "compression", 1.0, "x"),
]


def summary(trace):
    """{rank: {key: median or total}} and the table text."""
    per_rank = {}
    for rank, steps in sorted(trace.items()):
        figs = [step_figures(ev) for _, ev in sorted(steps.items())]
        s = {key: median([f[key] for f in figs]) for _, key, _, _ in ROWS}
        s["steps"] = len(figs)
        s["replans"] = int(sum(f["replans"] for f in figs))
        s["mispredictions"] = int(sum(f["mispredictions"] for f in figs))
        s["params"] = figs[0]["params"]
        per_rank[rank] = s
    ranks = sorted(per_rank)
    first = per_rank[ranks[0]]
    lines = [f"ddpx GradSync profile: {first['steps']} steps, {first['params']:.0f} parameter "
             f"tensors, {len(ranks)} ranks (medians per step)",
             "  " + f"{'metric':<30}" + "".join(f"{'rank ' + str(r):>12}" for r in ranks) + "  unit"]
    for label, key, scale, unit in ROWS:
        lines.append("  " + f"{label:<30}"
                     + "".join(f"{per_rank[r][key] * scale:12.3f}" for r in ranks) + f"  {unit}")
    for label, key in (("re-planning events", "replans"), ("unused mispredictions", "mispredictions")):
        lines.append("  " + f"{label:<30}" + "".join(f"{per_rank[r][key]:12d}" for r in ranks)
                     + f"  in {first['steps']} steps")
    return per_rank, "\n".join(lines)


COLORS = {"backward": "#9ecae1", "final_callback": "#fdd0a2", "final_wait": "#e6550d",
          "write_back": "#a1d99b", "hooks": "#756bb1", "allreduce": "#c6dbef",
          "gather": "#fdae6b",  # a sharded bucket's gather of its updated parts
          "encode": "#31a354", "wire": "#3182bd", "decode": "#dd3497",
          "step_agreement": "#fec44f", "phase": "#969696"}


def kind(name):
    base = name[len("ddpx::"):].split("[")[0]
    return base if base in COLORS else "phase"


def plot(trace, png, plot_steps):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted(trace)
    shown = sorted(next(iter(trace.values())))[:plot_steps]
    # Rows: per rank, its step track, hook lanes and channels (tid order).
    rows = []
    for r in ranks:
        tids = sorted({e["tid"] for s in shown for e in trace[r].get(s, [])})
        rows += [(r, t) for t in tids]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(13, 3 + 0.42 * len(rows) + 0.5 * len(ranks)),
                                 gridspec_kw={"height_ratios": [max(len(rows), 3), 2 + len(ranks)]})
    t_min = min(e["ts"] for r in ranks for s in shown for e in trace[r].get(s, []))
    for y, (r, tid) in enumerate(rows):
        for s in shown:
            for e in trace[r].get(s, []):
                if e["tid"] != tid:
                    continue
                x = (e["ts"] - t_min) / 1e3
                if e["ph"] == "X":
                    k = kind(e["name"])
                    inner = k in ("encode", "wire", "decode", "final_wait", "write_back")
                    h = 0.5 if inner else 0.8
                    ax.broken_barh([(x, max(e["dur"] / 1e3, 1e-4))], (y - h / 2, h),
                                   facecolors=COLORS[k], edgecolors="k", linewidth=0.3)
                elif e["name"].startswith(("ddpx::ready", "ddpx::launch")):
                    ax.plot([x], [y - 0.45], marker="v" if "ready" in e["name"] else "^",
                            color="k" if "ready" in e["name"] else "r", markersize=3)
    labels = []
    for r, tid in rows:
        name = ("step" if tid == 0 else "hooks" if tid < 1000 else f"channel {(tid - 1000) % 100}"
                + (f" lane {(tid - 1000) // 100 + 1}" if tid >= 1100 else ""))
        labels.append(f"rank {r} {name}")
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"GradSync timeline, steps {shown[0]}-{shown[-1]} "
                 "(v ready, ^ launch; bucket runs hold encode / wire / decode)")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / max(len(rows), 3)),
              ncol=len(COLORS), fontsize=7)

    # Where a median step goes, per rank: the step track's parts, in order.
    parts = defaultdict(dict)
    for r in ranks:
        figs = [step_figures(ev) for _, ev in sorted(trace[r].items())]
        p = parts[r]
        p["compute (backward - hooks)"] = median([f["backward_us"] - f["hooks_only_us"] for f in figs])
        p["hooks"] = median([f["hooks_only_us"] for f in figs])
        p["final callback CPU"] = median([f["exposed_us"] - f["final_wait_us"] - f["write_back_us"]
                                          for f in figs])
        p["exposed wait"] = median([f["final_wait_us"] for f in figs])
        p["write-back"] = median([f["write_back_us"] for f in figs])
        for name in sorted({n for f in figs for n in f["phases"]}):
            p[name] = median([f["phases"].get(name, 0) for f in figs])
    keys = list(dict.fromkeys(k for r in ranks for k in parts[r]))
    cmap = plt.get_cmap("tab10")
    for y, r in enumerate(ranks):
        left = 0.0
        for i, k in enumerate(keys):
            w = parts[r].get(k, 0) / 1e3
            bx.barh(y, w, left=left, color=cmap(i % 10), label=k if y == 0 else None)
            left += w
    bx.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    bx.invert_yaxis()
    bx.set_xlabel("ms per step (median)")
    bx.set_title("Where a step's time goes")
    bx.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=parse_steps, default=None, help="a:b, inclusive, 1-based")
    p.add_argument("--png", default=None, help="write a timeline + breakdown plot here")
    p.add_argument("--plot-steps", type=int, default=2, help="steps shown on the timeline")
    args = p.parse_args(argv)
    trace = load(args.trace, args.steps)
    _, table = summary(trace)
    print(table)
    if args.png:
        plot(trace, args.png, max(args.plot_steps, 1))
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
