"""Issue 22: DDP communication hooks and Future callbacks on ddpx_mpi.
PyTorch's PowerSGD hook waits on collectives from inside Future callbacks;
that must neither deadlock the backend's progress thread nor hang. Run under
mpirun with 2 and 3 ranks (ctest)."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP


@pytest.fixture(scope="module", autouse=True)
def world():
    dist.init_process_group(backend="ddpx_mpi")
    yield
    dist.destroy_process_group()


def rank_size():
    return dist.get_rank(), dist.get_world_size()


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 6))


def batches(n, steps):
    torch.manual_seed(1)
    return [(torch.randn(4 * n, 12), torch.randn(4 * n, 6)) for _ in range(steps)]


def train(model, data, rows, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def same_on_all_ranks(model):
    _, n = rank_size()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    got = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(got, flat)
    return all(torch.equal(g, flat) for g in got)


def test_ddp_fp16_hook_matches_one_process():
    r, n = rank_size()
    data = batches(n, 4)
    ref = mlp()
    train(ref, data, slice(None))
    model = DDP(mlp())
    model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    train(model, data, slice(4 * r, 4 * r + 4))
    for p, q in zip(model.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-3, atol=1e-3)
    assert same_on_all_ranks(model.module)


def test_ddp_powersgd_hook_trains():
    r, n = rank_size()
    data = batches(n, 1) * 15  # one batch over and over: the loss must fall
    model = DDP(mlp())
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                   start_powerSGD_iter=2, min_compression_rate=0.5,
                                   orthogonalization_epsilon=1e-8)
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    losses = train(model, data, slice(4 * r, 4 * r + 4), lr=0.2)
    assert losses[-1] < 0.8 * losses[0], losses
    assert same_on_all_ranks(model.module)


def test_callback_issues_and_waits_on_a_collective():
    r, n = rank_size()

    def cb(fut):
        x = torch.full((17,), float(r))
        # The inner collective must complete while this callback holds its thread.
        inner = dist.all_reduce(x, async_op=True).get_future().wait()[0]
        w = torch.ones(3)
        dist.all_reduce(w, async_op=True).wait()  # Work.wait inside a callback
        return fut.value()[0] + inner.sum() + w.sum()

    t = torch.ones(5)
    fut = dist.all_reduce(t, async_op=True).get_future().then(cb)
    got = fut.wait()
    want = torch.full((5,), float(n)) + 17 * n * (n - 1) / 2 + 3 * n
    assert torch.equal(got, want)


def test_nested_callbacks_chain():
    """A callback whose inner collective has its own callback that waits:
    several callbacks are blocked at once."""
    r, n = rank_size()

    def inner_cb(fut):
        y = torch.ones(2)
        dist.all_reduce(y, async_op=True).get_future().wait()
        return fut.value()[0] + y

    def outer_cb(fut):
        x = torch.ones(2)
        return dist.all_reduce(x, async_op=True).get_future().then(inner_cb).wait() + \
            fut.value()[0]

    # One chain at a time: callbacks that issue collectives must issue them in
    # the same order on every rank.
    for _ in range(3):
        f = dist.all_reduce(torch.ones(2), async_op=True).get_future().then(outer_cb)
        assert torch.equal(f.wait(), torch.full((2,), 3.0 * n))


# Issue 64: the collectives that Future callbacks issue reach MPI in the same
# order on every rank. PowerSGD's hook issues its P and Q all-reduces from the
# callbacks of each bucket's first all-reduce, while the caller issues the
# next bucket's. The test forces the two interleavings apart: rank 0's first
# callback of a step waits, and rank 1 issues bucket 1's all-reduce late. By
# thread timing, rank 0 then issued bucket 1's all-reduce before bucket 0's P
# and rank 1 after it: the ranks disagreed in every run, not in 2 of 7.
class _Delays:
    """Stands in for torch.distributed inside PowerSGD's module, delaying one
    all-reduce a step: the `nth` issued from the caller's thread ("caller") or
    from Future callbacks ("callback")."""

    def __init__(self, where, nth, seconds):
        self.where, self.nth, self.seconds = where, nth, seconds
        self.counts = None

    def new_step(self):
        self.counts = {"caller": 0, "callback": 0}

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, *args, **kwargs):
        import threading
        import time
        if self.counts is not None:
            caller = threading.current_thread() is threading.main_thread()
            where = "caller" if caller else "callback"
            if where == self.where and self.counts[where] == self.nth:
                time.sleep(self.seconds)
            self.counts[where] += 1
        return dist.all_reduce(*args, **kwargs)


def deep_mlp():
    torch.manual_seed(0)
    # Layers of distinct sizes: each bucket's P and Q differ in length, so a
    # misordered pair is a size mismatch (an error), never a silent swap.
    return torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24),
                               torch.nn.Tanh(), torch.nn.Linear(24, 8))


def train_powersgd(hook, group, rows, data, delays=None):
    model = DDP(deep_mlp(), process_group=group, bucket_cap_mb=0.0005)
    state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                   start_powerSGD_iter=2, min_compression_rate=0.5)
    buckets = set()

    def counting(s, bucket):
        buckets.add(bucket.index())
        return hook(s, bucket)

    model.register_comm_hook(state, counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        buckets.clear()
        if delays is not None:
            delays.new_step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
    return model.module, len(buckets)  # in the last step (DDP re-buckets after the first)


@pytest.mark.parametrize("hook", [powersgd.powerSGD_hook, powersgd.batched_powerSGD_hook],
                         ids=["powerSGD", "batched_powerSGD"])
def test_powersgd_with_several_buckets_equals_one_process_every_run(hook, monkeypatch):
    r, n = rank_size()
    if hook is powersgd.batched_powerSGD_hook:
        # torch's batched hook hands _orthogonalize a matrix, and that takes a
        # batch of matrices since pytorch#75157: an AssertionError on every
        # backend. Given a batch of one, the hook works as written.
        orthogonalize = powersgd._orthogonalize
        monkeypatch.setattr(powersgd, "_orthogonalize", lambda m, epsilon=0: orthogonalize(
            m.unsqueeze(0) if m.dim() == 2 else m, epsilon))
    torch.manual_seed(2)
    data = [(torch.randn(4 * n, 16), torch.randn(4 * n, 8)) for _ in range(5)]
    # Every rank computes the one-process reference (the whole batch, the same
    # hook) over a group of its own.
    solo = [dist.new_group([k]) for k in range(n)][r]
    ref, _ = train_powersgd(hook, solo, slice(None), data)
    delays = _Delays("callback", 0, 0.15) if r == 0 else _Delays("caller", 1, 0.15)
    monkeypatch.setattr(powersgd, "dist", delays)
    for _ in range(3):
        model, buckets = train_powersgd(hook, None, slice(4 * r, 4 * r + 4), data, delays)
        assert buckets >= 3, buckets
        # PowerSGD is linear in the gradient up to its orthogonalisation's
        # rounding: n ranks' halves equal one process's whole batch.
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        assert same_on_all_ranks(model)


def test_callback_waits_for_a_later_callbacks_collective():
    """Callback k issues its own all-reduce, then waits on the one callback
    k+1 issues: the order rule holds k+1's collectives behind callback k,
    which must still let them go once k only waits (no deadlock)."""
    import threading
    r, n = rank_size()
    chains = 3
    issued = [threading.Event() for _ in range(chains)]
    inner = [None] * chains
    seen = {}

    def callback(k):
        def run(fut):
            own = dist.all_reduce(torch.full((k + 2,), float(r)), async_op=True).get_future()
            inner[k] = own
            issued[k].set()
            total = own.wait()[0].sum()
            # A callback attached to a complete Future runs at once, on the
            # caller's thread, before k+1 exists: it cannot wait for it.
            if k + 1 < chains and threading.current_thread() is not threading.main_thread():
                assert issued[k + 1].wait(timeout=60)
                seen[k] = inner[k + 1].wait()[0].sum().item()
            return fut.value()[0] + total
        return run

    # Ahead of the chains: keeps the worker busy while they are attached.
    dist.all_reduce(torch.ones(1 << 20), async_op=True)
    futs = [dist.all_reduce(torch.ones(2), async_op=True).get_future().then(callback(k))
            for k in range(chains)]
    tri = n * (n - 1) / 2  # the sum of the ranks
    for k, f in enumerate(futs):
        assert torch.equal(f.wait(), torch.full((2,), n + (k + 2) * tri))
    assert seen, "every callback ran on the caller's thread"
    for k, v in seen.items():
        assert v == (k + 3) * tri
