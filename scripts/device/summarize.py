#!/usr/bin/env python3
"""The device check's summary: OUT_DIR/check.json from the steps check.sh
recorded (steps.tsv: name, status, seconds) and the benchmarks' JSON files
beside it, plus the card, torch and CUDA versions; prints a short table last
(the device call returns the end of the output). Exit status 1 when a step
did not pass (a rehearsal's dry steps, and the steps a resumed call left to
the last one, excepted).

    scripts/device/summarize.py OUT_DIR STEPS_TSV
"""
import datetime
import json
import platform
import sys
from pathlib import Path


def machine():
    try:
        import torch
    except ImportError:
        return {"torch": None}
    gpu = torch.cuda.is_available()
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "card": torch.cuda.get_device_name() if gpu else None,
            "cudnn": torch.backends.cudnn.version() if gpu else None,
            "host": platform.node()}


def main():
    out, steps_file = Path(sys.argv[1]), Path(sys.argv[2])
    steps = []
    for line in steps_file.read_text().splitlines():
        name, status, seconds = line.split("\t")
        steps.append({"name": name, "status": status, "seconds": int(seconds)})
    benches = {}
    for f in sorted(out.glob("*.json")):
        if f.name == "check.json" or f.name.endswith(".trace.json"):
            continue
        try:  # (a step cut by its time limit may leave a file half written)
            b = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            benches[f.stem] = {"error": f"unreadable: {e}", "file": f.name}
            continue
        if isinstance(b, dict) and "rows" in b:
            benches[b.get("name", f.stem)] = {"geomean_ratio": b.get("geomean_ratio"),
                                              "worst_ratio": b.get("worst_ratio"),
                                              "cases": len(b["rows"]), "file": f.name}
    summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": "scripts/device/check.sh " + " ".join(sys.argv[1:2]),
               **machine(), "steps": steps, "benches": benches}
    (out / "check.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n# device check: {summary.get('card')}, torch {summary.get('torch')}, "
          f"CUDA {summary.get('cuda')}")
    for s in steps:
        print(f"{s['name']:<32} {s['status']:<34} {s['seconds']:>5} s")
    def ratio(x):
        return "-" if x is None else f"{x:.3f}"
    for name, b in benches.items():
        if "error" in b:
            print(f"bench {name:<26} {b['error']}")
            continue
        print(f"bench {name:<26} geomean {ratio(b['geomean_ratio'])}  "
              f"worst {ratio(b['worst_ratio'])}  ({b['cases']} cases)")
    # (A rehearsal's dry steps, and the steps a resumed call left to the last
    # one, whose check.json has their status.)
    bad = [s for s in steps if s["status"] != "ok" and "rehearsal" not in s["status"]
           and not s["status"].startswith("last call:")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
