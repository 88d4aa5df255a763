"""The models of scripts/bench/ddp, defined once.

PyTorch DDP runs them from Python; the same modules are scripted and saved
(`export`) for the C++ driver (ddp_driver.cpp), which torch::jit::load's them
and runs naive all-reduce and GradSync. Every model has the same interface so
both sides drive it identically:

    loss = m(m.inputs(step, rank), step)      # forward returns the scalar loss

`inputs` is deterministic in (step, rank) and cheap (no RNG, so Python and C++
see the same numbers); `step` is an int argument so that models whose graph
changes with the step (unused parameters) are scriptable and take the same
branch in DDP and in C++.

Balance (scripts/bench/ddp calibrates it on the machine at hand, `calibrate`;
the defaults below were measured on one such machine): batch sizes are chosen
so that one 1-thread rank's backward takes
about as long as all-reducing the model's gradients alone over the emulated
1 Gbit/s link (both directions share the shaped loopback: about 16 ns per
float32 byte with 2 ranks): backward / comm measured 0.98 (mlp25m), 1.05
(cnn), ~1.0 (many520), 0.97 (unused), 1.00 (reordered); forward+backward is
1.5-1.8x comm. That is where overlap decides the step: a reduction that
overlaps backward perfectly hides the whole of communication (the step is
compute alone, the limit), and one that waits for backward's end adds all of
it. (Until 2026-11-22 compute alone matched comm, so comm exceeded backward
and part of it showed whatever the overlap: at each model's floor the suite's
ratio to DDP came to about 0.75, and no implementation could get within
1.3x the limit.)
"""
import re
import statistics
import time
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode


def _wave(n: int, cols: int, step: int, rank: int) -> Tensor:
    i = torch.arange(n * cols, dtype=torch.float32)
    return torch.sin(i * (0.0137 + 0.001 * rank) + float(step)).view(n, cols)


class MLP25M(nn.Module):
    """~25M parameters in 8 tensors: large buckets, few hooks."""

    def __init__(self, batch: int = 2560):
        super().__init__()
        self.batch = batch
        self.l1 = nn.Linear(1024, 4096)
        self.l2 = nn.Linear(4096, 4096)
        self.l3 = nn.Linear(4096, 1024)
        self.l4 = nn.Linear(1024, 10)

    @torch.jit.export
    def inputs(self, step: int, rank: int) -> Tensor:
        return _wave(self.batch, 1024, step, rank)

    def forward(self, x: Tensor, step: int) -> Tensor:
        h = torch.relu(self.l1(x))
        h = torch.relu(self.l2(h))
        h = torch.relu(self.l3(h))
        return self.l4(h).pow(2).mean()


class SmallCNN(nn.Module):
    """A small CNN (2.4M parameters, most in fc1): convolutions compute, fc1
    communicates."""

    def __init__(self, batch: int = 180):
        super().__init__()
        self.batch = batch
        self.c1 = nn.Conv2d(3, 32, 3, padding=1)
        self.c2 = nn.Conv2d(32, 64, 3, padding=1)
        self.c3 = nn.Conv2d(64, 128, 3, padding=1)
        self.c4 = nn.Conv2d(128, 128, 3, padding=1)
        self.fc1 = nn.Linear(128 * 4 * 4, 1024)
        self.fc2 = nn.Linear(1024, 10)

    @torch.jit.export
    def inputs(self, step: int, rank: int) -> Tensor:
        return _wave(self.batch, 3 * 32 * 32, step, rank).view(self.batch, 3, 32, 32)

    def forward(self, x: Tensor, step: int) -> Tensor:
        h = torch.max_pool2d(torch.relu(self.c1(x)), 2)  # 16x16
        h = torch.max_pool2d(torch.relu(self.c2(h)), 2)  # 8x8
        h = torch.relu(self.c3(h))
        h = torch.max_pool2d(torch.relu(self.c4(h)), 2)  # 4x4
        h = torch.relu(self.fc1(h.flatten(1)))
        return self.fc2(h).pow(2).mean()


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.norm(self.fc(x)))


class ManyTensors(nn.Module):
    """130 residual blocks x 4 tensors = 520 small parameter tensors: the
    per-tensor cost of the hook dominates here, not the bytes."""

    def __init__(self, blocks: int = 130, width: int = 128, batch: int = 1400):
        super().__init__()
        self.batch = batch
        self.width = width
        self.blocks = nn.ModuleList([Block(width) for _ in range(blocks)])

    @torch.jit.export
    def inputs(self, step: int, rank: int) -> Tensor:
        return _wave(self.batch, self.width, step, rank)

    def forward(self, x: Tensor, step: int) -> Tensor:
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


class Unused(nn.Module):
    """A trunk and two experts; even steps use expert a, odd steps expert b,
    so a third of the parameters get no gradient on every step (DDP needs
    find_unused_parameters=True)."""

    def __init__(self, batch: int = 3640):
        super().__init__()
        self.batch = batch
        self.trunk1 = nn.Linear(1024, 2048)
        self.trunk2 = nn.Linear(2048, 1024)
        self.expert_a = nn.Linear(1024, 2048)
        self.expert_b = nn.Linear(1024, 2048)
        self.head = nn.Linear(2048, 10)

    @torch.jit.export
    def inputs(self, step: int, rank: int) -> Tensor:
        return _wave(self.batch, 1024, step, rank)

    def forward(self, x: Tensor, step: int) -> Tensor:
        h = torch.relu(self.trunk2(torch.relu(self.trunk1(x))))
        e = self.expert_a(h) if step % 2 == 0 else self.expert_b(h)
        return self.head(torch.relu(e)).pow(2).mean()


class Reordered(nn.Module):
    """Eight layers applied in the reverse of their registration order, so the
    backward order is the registration order: the usual first guess (reverse
    registration) is exactly wrong until the order is learned."""

    def __init__(self, batch: int = 2500):
        super().__init__()
        self.batch = batch
        self.l0 = nn.Linear(1024, 1024)
        self.l1 = nn.Linear(1024, 1024)
        self.l2 = nn.Linear(1024, 1024)
        self.l3 = nn.Linear(1024, 1024)
        self.l4 = nn.Linear(1024, 1024)
        self.l5 = nn.Linear(1024, 1024)
        self.l6 = nn.Linear(1024, 1024)
        self.l7 = nn.Linear(1024, 1024)

    @torch.jit.export
    def inputs(self, step: int, rank: int) -> Tensor:
        return _wave(self.batch, 1024, step, rank)

    def forward(self, x: Tensor, step: int) -> Tensor:
        h = torch.tanh(self.l7(x))
        h = torch.tanh(self.l6(h))
        h = torch.tanh(self.l5(h))
        h = torch.tanh(self.l4(h))
        h = torch.tanh(self.l3(h))
        h = torch.tanh(self.l2(h))
        h = torch.tanh(self.l1(h))
        return self.l0(h).pow(2).mean()


class SparseTable(nn.Module):
    """A recommender's shape: a 250k x 32 embedding table with sparse
    gradients (Embedding(sparse=True); a step touches 10240 rows per rank,
    1.3 MB of its 32 MB) and a dense MLP head (1.1M parameters). DDP
    all-reduces the table with Gloo's sparse all-reduce, GradSync gathers its
    rows (hooks/sparse_reduce.h); comm (dense buckets) is what sending the
    table whole would cost. Not in the issue's suite (SUITE): run it with
    --models embedding."""

    def __init__(self, batch: int = 512, rows: int = 250_000, dim: int = 32, ids: int = 20):
        super().__init__()
        self.batch = batch
        self.rows = rows
        self.ids = ids
        self.emb = nn.Embedding(rows, dim, sparse=True)
        self.l1 = nn.Linear(dim, 1024)
        self.l2 = nn.Linear(1024, 1024)
        self.l3 = nn.Linear(1024, 1)

    @torch.jit.export
    def inputs(self, step: int, rank: int) -> Tensor:
        # distinct rows (7919 is prime to rows), shifted per step and rank
        i = torch.arange(self.batch * self.ids, dtype=torch.int64)
        return ((i * 7919 + step * 104729 + rank * 1299709) % self.rows).view(self.batch, self.ids)

    def forward(self, x: Tensor, step: int) -> Tensor:
        h = self.emb(x).sum(1)
        h = torch.relu(self.l1(h))
        h = torch.relu(self.l2(h))
        return self.l3(h).pow(2).mean()


# name -> (constructor, find_unused_parameters needed by DDP)
MODELS = {
    "mlp25m": (MLP25M, False),
    "cnn": (SmallCNN, False),
    "many520": (ManyTensors, False),
    "unused": (Unused, True),
    "reordered": (Reordered, False),
    "embedding": (SparseTable, False),
}
# Models with sparse gradients. DDP recognises a sparse parameter by its
# module (an nn.Embedding with sparse=True), so it runs these eagerly, not
# scripted, and without gradient_as_bucket_view, which sparse gradients
# cannot be.
SPARSE = {"embedding"}
# The benchmark suite, run by default (and the geomean's models).
SUITE = ["mlp25m", "cnn", "many520", "unused", "reordered"]
# --quick: two models of ~0.6 s a step here (1 thread per rank), one round.
QUICK = ["cnn", "many520"]


def make(name: str, batch: Optional[int] = None) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]() if batch is None else MODELS[name][0](batch=batch)


def export(names: List[str], out_dir, batches: Optional[Dict[str, int]] = None) -> None:
    """Scripts and saves each model as <out_dir>/<name>.pt (batch: `batches`
    where given, else the model's default)."""
    for name in names:
        torch.jit.script(make(name, (batches or {}).get(name))).save(str(out_dir / f"{name}.pt"))


def rate_bits_per_s(rate: str) -> float:
    """tc's rate syntax as used here: 1gbit, 250mbit, 10kbit."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"cannot read the link rate '{rate}' (e.g. 1gbit, 250mbit)")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def backward_ms(m: nn.Module, steps: int = 3) -> float:
    """One rank's backward of `m` (median of `steps` after a warm-up step)."""
    times = []
    for step in range(steps + 1):
        loss = m(m.inputs(step, 0), step)
        t0 = time.perf_counter()
        loss.backward()
        if step:
            times.append((time.perf_counter() - t0) * 1e3)
        for p in m.parameters():
            p.grad = None
    return statistics.median(times)


def comm_ms(m: nn.Module, bits_per_s: float) -> float:
    """All-reducing m's float32 gradients between 2 ranks on the shaped
    loopback: both ranks' bytes cross the one link."""
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    return 2 * nbytes * 8 / bits_per_s * 1e3


def calibrate(names: List[str], rate: str, threads: int, log=print) -> Dict[str, int]:
    """Each dense model's batch such that one rank's backward (on `threads`
    threads) takes as long as all-reducing its gradients on the link (`rate`)
    on the machine at hand: backward is near linear in the batch, so the
    batch is scaled by comm / backward until the two are within 5% (at most
    three times: fixed costs and caches bend the line). Sparse models keep
    their batch (their bytes depend on the ids)."""
    bits = rate_bits_per_s(rate)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _calibrate(names, rate, bits, log)
    finally:
        torch.set_num_threads(before)


def _calibrate(names: List[str], rate: str, bits: float, log) -> Dict[str, int]:
    batches = {}
    for name in names:
        if name in SPARSE:
            continue
        default = make(name).batch
        batch = default
        for attempt in range(4):
            m = torch.jit.script(make(name, batch))
            bwd, comm = backward_ms(m), comm_ms(m, bits)
            if abs(bwd / comm - 1) <= 0.05 or attempt == 3:
                break
            batch = max(1, round(batch * comm / bwd))
        log(f"# calibrated {name}: batch {default} -> {batch}, backward {bwd:.0f} ms, "
            f"comm on {rate} {comm:.0f} ms (estimated), backward / comm {bwd / comm:.2f}")
        batches[name] = batch
    return batches


class _FirstUse(TorchFunctionMode):
    """Notes the time of each parameter's first use in a forward (as an
    argument of a torch function: F.linear, F.conv2d, F.layer_norm, ...)."""

    def __init__(self, ids: Dict[int, int]):
        super().__init__()
        self.ids, self.at = ids, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        now = time.perf_counter()
        for a in list(args) + list((kwargs or {}).values()):
            k = self.ids.get(id(a))
            if k is not None and k not in self.at:
                self.at[k] = now
        return func(*args, **(kwargs or {}))


def layer_profile(name: str, batch: Optional[int] = None, threads: int = 1,
                  steps: int = 3) -> List[Dict[str, float]]:
    """Per parameter that gets a gradient (step 0's, eager, one rank): its
    bytes, its first use as a fraction of the forward and its gradient's
    arrival as a fraction of the backward (medians of `steps` after a
    warm-up). The gated floor per layer (scripts/bench/ddp) scales these to
    the C++ driver's measured forward and backward."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m = make(name, batch)
        params = list(m.parameters())
        ids = {id(p): k for k, p in enumerate(params)}
        ready: Dict[int, float] = {}

        def note(k: int):
            def hook(_p):
                ready.setdefault(k, time.perf_counter())
            return hook

        hooks = [p.register_post_accumulate_grad_hook(note(k)) for k, p in enumerate(params)]
        use, arrive = {}, {}
        for step in range(steps + 1):
            x = m.inputs(0, 0)
            mode = _FirstUse(ids)
            t0 = time.perf_counter()
            with mode:
                loss = m(x, 0)
            t1 = time.perf_counter()
            ready.clear()
            loss.backward()
            t2 = time.perf_counter()
            for p in params:
                p.grad = None
            if not step:
                continue
            for k, t in ready.items():
                use.setdefault(k, []).append((mode.at.get(k, t1) - t0) / (t1 - t0))
                arrive.setdefault(k, []).append((t - t1) / (t2 - t1))
        for h in hooks:
            h.remove()
        return [{"bytes": params[k].numel() * params[k].element_size(),
                 "use": statistics.median(use[k]), "ready": statistics.median(arrive[k])}
                for k in sorted(arrive)]
    finally:
        torch.set_num_threads(before)
