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
