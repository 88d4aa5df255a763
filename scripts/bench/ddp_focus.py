"""scripts/bench/ddp --focus: GradSync against DDP alone, the figures issue
60's targets name, with enough steps to tell them apart.

The full bench times ~15 variants per model; on a lent GPU its --quick form
fits only 3 timed steps and one round, and there the spread swamped the
differences (on the H200 on 2026-11-30 GradSync with an SGD step came out
14 ms faster than without one on many520). --focus runs only DDP and the
GradSync variants the targets compare -- over Gloo on one group (two
buckets in flight, calls_in_flight's default, as DDP's one group with two
threads), the same one bucket at a time (serial), over Gloo on two groups,
over ddpx_mpi -- plus compute and comm for the limit, 20 timed steps in 3
rounds unless told otherwise, each round's DDP job right before its C++ job.
"""
import benchlib

# The C++ driver's variants --focus runs, in order.
CXX_VARIANTS = ["compute", "comm_gloo", "comm_mpi", "gradsync_gloo", "gradsync_gloo_serial",
                "gradsync_gloo_2ch", "gradsync_mpi"]
COLUMNS = ["model", "tensors", "MB", "compute_ms", "comm_ms", "limit_ms", "ddp_ms", "gs_gloo_ms",
           "gs_gloo_serial_ms", "gs_gloo_2ch_ms", "gs_mpi_ms", "ratio", "ratio_lo", "ratio_hi",
           "serial_ratio", "two_channel_ratio", "mpi_ratio", "exposed", "ddp_exposed", "replans"]
RATIOS = ("serial_ratio", "two_channel_ratio", "mpi_ratio")


def row(by, name, rounds):
    """One model's row (KeyError: a variant has no record); rounds: each
    round's gradsync_gloo / ddp."""
    get = lambda v: by[(name, v)]["step_ms"]  # noqa: E731
    gs = by[(name, "gradsync_gloo")]
    ddp = get("ddp")
    compute = get("compute")
    return {
        "model": name, "tensors": gs["tensors"], "MB": gs["numel"] * 4 / 2**20,
        "compute_ms": compute, "comm_ms": get("comm_gloo"),
        "limit_ms": max(compute, get("comm_gloo")), "ddp_ms": ddp,
        "gs_gloo_ms": get("gradsync_gloo"), "gs_gloo_serial_ms": get("gradsync_gloo_serial"),
        "gs_gloo_2ch_ms": get("gradsync_gloo_2ch"),
        "gs_mpi_ms": get("gradsync_mpi"),
        "ratio": get("gradsync_gloo") / ddp, "ratio_lo": min(rounds), "ratio_hi": max(rounds),
        "serial_ratio": get("gradsync_gloo_serial") / ddp,
        "two_channel_ratio": get("gradsync_gloo_2ch") / ddp,
        "mpi_ratio": get("gradsync_mpi") / ddp,
        "exposed": gs["exposed_comm_us"] / 1e3 / get("gradsync_gloo"),
        "ddp_exposed": max(0.0, ddp - compute) / ddp,
        "replans": gs["replans"],
    }


def report(name, rows, extra):
    """Prints the focused rows (row()'s, or errors) and the targets; saves
    `name`.json."""
    full = [r for r in rows if "error" not in r]
    for key, label in (("ratio", "Gloo, one group"), ("two_channel_ratio", "Gloo, two groups"),
                       ("mpi_ratio", "ddpx_mpi")):
        g = benchlib.geomean([r[key] for r in full])
        worst = max((r[key] for r in full), default=float("nan"))
        met = bool(full) and worst <= 1.0 and g <= 0.85
        print(f"# target {'met' if met else 'MISSED'}: GradSync / DDP <= 1.0 on every model and "
              f"geomean <= 0.85 over {label} (geomean {g:.3f}, worst {worst:.3f})")
    benchlib.report(name, COLUMNS, rows, also=RATIOS, extra=extra)
