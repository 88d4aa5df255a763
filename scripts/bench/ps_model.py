"""Strong scaling of the parameter server on paper (issue 45, part 4):
samples/s against worker count for dedicated and colocated servers, beside
GradSync's ring all-reduce, from the costs scripts/bench/ps measures. That
bench checks the model against its own measured points (2 ranks, the shaped
1 Gbit/s loopback) and prints it for 10 and 100 Gbit/s links.

Inputs (measured):
  C  one rank's compute per step (forward, backward, update), s; a
     straggler slowed f x computes f C
  M  the gradient bytes of the model (float32), a full push or pull
  b  samples per step of one worker
  o  the fixed cost of one push -> apply -> reply round trip beyond its
     bytes (MPI messages, the server's thread, the optimizer on the shard):
     a dedicated worker's measured wait per step minus 2 M / B

Bytes on the wire per worker step (one push and its reply; GradSync: one
all-reduce per step of each rank):
  dedicated             2 M            push M to the servers, pull M back
  colocated, W ranks    2 (W-1)/W M    the rank's own shard never leaves it
  GradSync ring, W      2 (W-1)/W M    reduce-scatter + all-gather
Colocated moves a ring's bytes; a dedicated layout moves (nearly) twice that
at W = 2 and funnels N M / K through each server link.

Links:
  bus       every byte of every rank crosses one device of B bytes/s (this
            machine: the ranks share one tc-shaped loopback, both ways)
  switched  each rank has its own full-duplex link of B bytes/s each way
            (a non-blocking switch): a link carries at most B one way

Time per step of worker i, its messages not overlapped with its compute
(pulls after each push):
  PS        T_i = f_i C + 2 m / B + o      m: its own bytes one way
                                            (dedicated M, colocated (W-1)/W M)
  GradSync  T   = max_i f_i C + 2 (W-1)/W M / B + o    (in lockstep: the
            slowest rank sets every step; its overlap with backward is left
            out, so this is GradSync's slowest case)
Throughput is the smaller of the workers' pace and what the links carry:
  PS (async)  b * min(sum_i 1 / T_i, cap)
  GradSync    b * W * min(1 / T, cap / W)
  cap, worker steps per second the links allow:
    bus        B / (bytes per worker step)
    switched   dedicated: K B / M (each server link, one way, N workers)
                          and B / M per worker (its own link, in T_i)
               colocated and ring: W B / (2 (W-1)/W M), per link one way
                          (every rank's link carries the same)
Assumptions, said where they matter: the servers' optimizer time is in o
and does not grow with W (each colocated shard is 1/W of the model, each
dedicated server's N / K times as many updates as one worker's); no
congestion beyond the bandwidth; an async worker never waits on another.
"""

GBIT = 1e9 / 8  # bytes/s of 1 Gbit/s


def _bytes_one_way(layout, m_bytes, w):
    """A worker's own bytes one way per step."""
    return m_bytes if layout == "dedicated" else (w - 1) / w * m_bytes


def _cap(layout, link, m_bytes, w, servers):
    """Worker steps per second the links allow."""
    per_step = 2 * _bytes_one_way(layout, m_bytes, w) if layout != "gradsync" else \
        2 * (w - 1) / w * m_bytes
    if per_step == 0:
        return float("inf")
    if link["kind"] == "bus":
        return link["B"] / per_step
    if layout == "dedicated":
        return servers * link["B"] / m_bytes
    return w * link["B"] / per_step


def samples_per_s(layout, workers, c_s, m_bytes, batch, overhead_s, link, factors=None,
                  servers=1):
    """Predicted samples/s. layout: dedicated | colocated | gradsync;
    workers: N (dedicated: besides `servers` server ranks; else the world
    size W); factors: each worker's slowdown (default all 1)."""
    f = list(factors or [1.0] * workers)
    assert len(f) == workers
    w = workers
    if layout == "gradsync":
        t = max(f) * c_s + 2 * (w - 1) / w * m_bytes / link["B"] + overhead_s
        return batch * w * min(1 / t, _cap(layout, link, m_bytes, w, servers) / w)
    m = _bytes_one_way(layout, m_bytes, w)
    pace = sum(1 / (fi * c_s + 2 * m / link["B"] + overhead_s) for fi in f)
    return batch * min(pace, _cap(layout, link, m_bytes, w, servers))


def table(c_s, m_bytes, batch, overhead_s, gbits=(10, 100), counts=(2, 4, 8, 16, 32, 64),
          servers_per=8):
    """Rows of predicted samples/s on switched links: per link rate and
    worker count, GradSync, colocated, and dedicated with one server per
    `servers_per` workers (at least one), each with no straggler and with
    one worker 2x slower."""
    rows = []
    for g in gbits:
        link = {"kind": "switched", "B": g * GBIT}
        for n in counts:
            k = max(1, n // servers_per)
            row = {"link": f"{g} Gbit/s", "workers": n, "servers": k}
            for name, layout, kw in (("gradsync", "gradsync", {}), ("colocated", "colocated", {}),
                                     ("dedicated", "dedicated", {"servers": k})):
                for tag, fac in (("", None), ("_x2", [2.0] + [1.0] * (n - 1))):
                    row[name + tag] = samples_per_s(layout, n, c_s, m_bytes, batch, overhead_s,
                                                    link, fac, **kw)
            rows.append(row)
    return rows
