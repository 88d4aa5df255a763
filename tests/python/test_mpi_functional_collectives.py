"""Issue 22: what DTensor, FSDP2 and torch.compile'd distributed code need
from ddpx_mpi. Functional collectives, the coalesced collectives (tensor
and list forms), the coalescing manager, DTensor redistribution and FSDP2
training, each against a reference computed locally from the known inputs
of every rank. Run under mpirun with 2 and 3 ranks (ctest)."""
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _coalescing_manager

# torch 2.11 (the lent GPU machine's) names these all_gather_tensor,
# reduce_scatter_tensor and *_tensor_coalesced; 2.15 keeps those as aliases of
# the *_single names. The tests run on both through whichever the torch has.
all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
reduce_scatter_single = (getattr(funcol, "reduce_scatter_single", None)
                         or funcol.reduce_scatter_tensor)
all_gather_single_coalesced = (getattr(funcol, "all_gather_single_coalesced", None)
                               or funcol.all_gather_into_tensor_coalesced)
reduce_scatter_single_coalesced = (getattr(funcol, "reduce_scatter_single_coalesced", None)
                                   or funcol.reduce_scatter_tensor_coalesced)


def pg_method(pg, name, old_name):
    return getattr(pg, name, None) or getattr(pg, old_name)


wait_tensors = (getattr(funcol, "wait_tensors", None)
                or (lambda ts: [funcol.wait_tensor(t) for t in ts]))
# What torch 2.11 itself refuses before a backend is reached: non-contiguous
# inputs of the functional all-gather / reduce-scatter, and monitored_barrier
# on any backend but Gloo.
OLD_TORCH = torch.torch_version.TorchVersion(torch.__version__) < "2.15"
old_torch_refuses = pytest.mark.skipif(
    OLD_TORCH, reason=f"torch {torch.__version__} refuses this before ddpx_mpi is reached")


# Odd sizes and an empty one (DESIGN.md, tests).
SIZES = [1, 17, 97, 0]


@pytest.fixture(scope="module", autouse=True)
def world():
    dist.init_process_group(backend="ddpx_mpi")
    yield
    dist.destroy_process_group()


def rank_size():
    return dist.get_rank(), dist.get_world_size()


def data(rank, shape, dtype=torch.float32):
    """Rank `rank`'s input: small integers, so sums are exact in any dtype."""
    n = 1
    for s in shape:
        n *= s
    return ((torch.arange(n) * 3 + 7 * rank) % 11).reshape(shape).to(dtype)


def noncontig(t):
    """The same values as `t` in a non-contiguous tensor (a strided slice)."""
    wide = torch.empty((*t.shape, 2), dtype=t.dtype)
    wide[..., 0] = t
    out = wide[..., 0]
    assert t.numel() <= 1 or not out.is_contiguous()
    return out


WORLD = lambda: dist.group.WORLD  # noqa: E731  (resolved after init)


# --- functional collectives ---------------------------------------------------

@pytest.mark.parametrize("rows", SIZES)
@pytest.mark.parametrize("contiguous", [True, False])
def test_functional_all_reduce(rows, contiguous):
    r, n = rank_size()
    t = data(r, (rows, 3))
    inp = t if contiguous else noncontig(t)
    out = funcol.wait_tensor(funcol.all_reduce(inp, "sum", WORLD()))
    assert torch.equal(out, sum(data(k, (rows, 3)) for k in range(n)))
    assert torch.equal(inp, t)  # functional: the input is left alone
    avg = funcol.wait_tensor(funcol.all_reduce(inp.double(), "avg", WORLD()))
    assert torch.allclose(avg, sum(data(k, (rows, 3)).double() for k in range(n)) / n)


@pytest.mark.parametrize("rows", SIZES)
@pytest.mark.parametrize("contiguous", [True, pytest.param(False, marks=old_torch_refuses)])
def test_functional_all_gather_into_tensor(rows, contiguous):
    r, n = rank_size()
    t = data(r, (rows, 5), torch.int64)
    inp = t if contiguous else noncontig(t)
    out = funcol.wait_tensor(all_gather_single(inp, 0, WORLD()))
    assert torch.equal(out, torch.cat([data(k, (rows, 5), torch.int64) for k in range(n)]))


@pytest.mark.parametrize("rows", SIZES)
@pytest.mark.parametrize("scatter_dim", [0, 1])
@pytest.mark.parametrize("contiguous", [True, pytest.param(False, marks=old_torch_refuses)])
def test_functional_reduce_scatter_tensor(rows, scatter_dim, contiguous):
    r, n = rank_size()
    shape = (rows * n, 4) if scatter_dim == 0 else (4, rows * n)
    inp = data(r, shape) if contiguous else noncontig(data(r, shape))
    out = funcol.wait_tensor(reduce_scatter_single(inp, "sum", scatter_dim, WORLD()))
    want = sum(data(k, shape) for k in range(n)).chunk(n, dim=scatter_dim)[r]
    assert torch.equal(out, want)


def test_functional_all_to_all_single_uneven():
    r, n = rank_size()
    # Rank i sends (i + j) % 3 rows to rank j (some zero), rows tagged 100*src + dst.
    send_rows = [(r + j) % 3 for j in range(n)]
    recv_rows = [(i + r) % 3 for i in range(n)]
    inp = torch.cat([torch.full((send_rows[j], 2), 100.0 * r + j) for j in range(n)])
    out = funcol.wait_tensor(funcol.all_to_all_single(inp, recv_rows, send_rows, WORLD()))
    want = torch.cat([torch.full((recv_rows[i], 2), 100.0 * i + r) for i in range(n)])
    assert torch.equal(out, want)


# --- coalesced collectives ----------------------------------------------------

def coalesced_inputs(r):
    """Mixed sizes (odd, one, empty) and dtypes, one non-contiguous."""
    return [data(r, (17, 3)), noncontig(data(r, (1,), torch.int64)), data(r, (0, 2)),
            data(r, (97,), torch.float64)]


def test_functional_all_gather_coalesced():
    r, n = rank_size()
    outs = wait_tensors(all_gather_single_coalesced(coalesced_inputs(r), WORLD()))
    for i, out in enumerate(outs):
        assert torch.equal(out, torch.cat([coalesced_inputs(k)[i] for k in range(n)])), i
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        outs = funcol.all_gather_into_tensor_coalesced(coalesced_inputs(r), WORLD())
    assert torch.equal(funcol.wait_tensor(outs[0]),
                       torch.cat([coalesced_inputs(k)[0] for k in range(n)]))


def test_functional_reduce_scatter_coalesced():
    r, n = rank_size()
    shapes = [(17 * n, 3), (n,), (0,), (2, 5 * n)]
    dims = [0, 0, 0, 1]
    dtypes = [torch.float32, torch.int64, torch.float32, torch.float64]
    # (torch 2.11 refuses a non-contiguous input here before ddpx_mpi is reached)
    inputs = [noncontig(data(r, s, d)) if i == 0 and not OLD_TORCH else data(r, s, d)
              for i, (s, d) in enumerate(zip(shapes, dtypes))]
    outs = wait_tensors(
        reduce_scatter_single_coalesced(inputs, "sum", dims, WORLD()))
    for s, d, dim, out in zip(shapes, dtypes, dims, outs):
        want = sum(data(k, s, d) for k in range(n)).chunk(n, dim=dim)[r] if s[0] else data(0, s, d)
        assert torch.equal(out, want), (s, d)


def list_inputs(r):
    """As coalesced_inputs, in one dtype (torch's Python API requires it)."""
    return [t.double() for t in coalesced_inputs(r)]


def test_all_gather_coalesced_list_form():
    r, n = rank_size()
    inputs = list_inputs(r)
    outputs = [[torch.full_like(t, -1) for t in inputs] for _ in range(n)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_coalesced(outputs, inputs)
    for k in range(n):
        for got, want in zip(outputs[k], list_inputs(k)):
            assert torch.equal(got, want)
    # Non-contiguous outputs are written through.
    outputs = [[noncontig(torch.zeros(17, 3))] for _ in range(n)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_coalesced(outputs, [data(r, (17, 3))])
    assert all(torch.equal(outputs[k][0], data(k, (17, 3))) for k in range(n))


def test_coalesced_errors_name_the_argument():
    r, n = rank_size()
    pg = dist.distributed_c10d._get_default_group()
    with pytest.raises(RuntimeError, match="output_lists.*group size"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_coalesced([[torch.zeros(2)]] * (n + 1), [torch.zeros(2)])
    with pytest.raises(RuntimeError, match=r"outputs\[0\]"):
        pg_method(pg, "all_gather_single_coalesced", "allgather_into_tensor_coalesced")(
            [torch.zeros(3 * n)], [torch.zeros(2)]).wait()
    with pytest.raises(RuntimeError, match="same number of"):
        pg_method(pg, "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")(
            [torch.zeros(2)], [torch.zeros(2 * n)] * 2).wait()
    t = torch.ones(2)
    dist.all_reduce(t)  # the group is still usable
    assert torch.equal(t, torch.full((2,), float(n)))


# --- the coalescing manager ---------------------------------------------------

@pytest.mark.parametrize("device", [None, "cpu"])
def test_coalescing_manager_fast_path(device):
    r, n = rank_size()
    dev = torch.device(device) if device else None
    outs = [torch.empty(s * n) for s in (17, 1, 0)]
    with _coalescing_manager(device=dev):
        for o, s in zip(outs, (17, 1, 0)):
            dist.all_gather_into_tensor(o, data(r, (s,)))
    for o, s in zip(outs, (17, 1, 0)):
        assert torch.equal(o, torch.cat([data(k, (s,)) for k in range(n)]))
    rs = [torch.empty(s) for s in (17, 1)]
    with _coalescing_manager(device=dev, async_ops=True) as cm:
        for o, s in zip(rs, (17, 1)):
            dist.reduce_scatter_tensor(o, data(r, (s * n,)))
    cm.wait()
    for o, s in zip(rs, (17, 1)):
        assert torch.equal(o, sum(data(k, (s * n,)) for k in range(n))[r * s:(r + 1) * s])
    ts = [data(r, (s,)) for s in (97, 1)]
    with _coalescing_manager(device=dev):
        for t in ts:
            dist.all_reduce(t)
    for t, s in zip(ts, (97, 1)):
        assert torch.equal(t, sum(data(k, (s,)) for k in range(n)))


def test_coalescing_manager_backend_block():
    """start/endCoalescing: collectives that have no fast path (broadcast,
    send/recv) issued inside the block, one Work for all of them."""
    r, n = rank_size()
    b = data(r, (97,))
    send = torch.full((5,), float(r))
    recv = torch.empty(5)
    with _coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        dist.broadcast(b, src=n - 1)
        dist.isend(send, dst=(r + 1) % n)
        dist.irecv(recv, src=(r - 1) % n)
    cm.wait()
    assert torch.equal(b, data(n - 1, (97,)))
    assert torch.equal(recv, torch.full((5,), float((r - 1) % n)))
    # An empty block is a completed Work.
    with _coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        pass
    cm.wait()


def test_batch_isend_irecv_ring():
    r, n = rank_size()
    send = torch.full((17,), float(r))
    recv = torch.empty(17)
    ops = [dist.P2POp(dist.isend, send, (r + 1) % n), dist.P2POp(dist.irecv, recv, (r - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(recv, torch.full((17,), float((r - 1) % n)))


def test_coalescing_errors():
    pg = dist.distributed_c10d._get_default_group()
    cpu = torch.device("cpu")
    assert pg._get_backend(cpu).supports_coalescing
    with pytest.raises(RuntimeError, match="endCoalescing without startCoalescing"):
        pg._end_coalescing(cpu)
    pg._start_coalescing(cpu)
    with pytest.raises(RuntimeError, match="already coalescing"):
        pg._start_coalescing(cpu)
    pg._end_coalescing(cpu).wait()


# --- DTensor ------------------------------------------------------------------

def test_dtensor_redistribute_and_full_tensor():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    r, n = rank_size()
    mesh = init_device_mesh("cpu", (n,))
    full = data(0, (17, 5))  # 17 rows: uneven shards at 2 and 3 ranks
    dt = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(dt.to_local(), full.chunk(n)[r])
    assert torch.equal(dt.full_tensor(), full)
    rep = dt.redistribute(mesh, [Replicate()])
    assert torch.equal(rep.to_local(), full)
    back = rep.redistribute(mesh, [Shard(0)])
    assert torch.equal(back.full_tensor(), full)
    col = distribute_tensor(full, mesh, [Shard(1)]).redistribute(mesh, [Shard(0)])
    assert torch.equal(col.full_tensor(), full)
    # Partial -> Replicate is an all-reduce.
    s = (dt * 2).sum()
    assert torch.equal(s.full_tensor(), full.sum() * 2)


# --- FSDP2 --------------------------------------------------------------------

def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))


def test_fsdp2_trains_like_one_process():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    r, n = rank_size()
    torch.manual_seed(1)
    batch = 6 * n
    xs = [torch.randn(batch, 7) for _ in range(3)]
    ys = [torch.randn(batch, 5) for _ in range(3)]

    ref = mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in zip(xs, ys):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()

    model = mlp()
    mesh = init_device_mesh("cpu", (n,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = slice(r * 6, (r + 1) * 6)
    for x, y in zip(xs, ys):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


# --- other entry points Gloo has for CPU tensors --------------------------------

def test_sparse_all_reduce_sums_like_dense():
    r, n = rank_size()
    # Rank r holds rows {r, r+1, 5} of a [7, 3] matrix (overlapping across ranks);
    # with 3 ranks rank 2 holds none.
    rows = [] if r == 2 else [r, r + 1, 5]
    dense = torch.zeros(7, 3)
    for i in rows:
        dense[i] = data(r, (3,)) + i
    sp = dense.to_sparse(sparse_dim=1)
    dist.all_reduce(sp)
    want = torch.zeros(7, 3)
    for k in range(n):
        for i in ([] if k == 2 else [k, k + 1, 5]):
            want[i] += data(k, (3,)) + i
    assert sp.is_sparse
    assert torch.equal(sp.to_dense(), want)
    with pytest.raises(RuntimeError, match="only ReduceOp.SUM"):
        dist.all_reduce(dense.to_sparse(), op=dist.ReduceOp.MAX)


@old_torch_refuses
def test_monitored_barrier():
    import datetime
    dist.monitored_barrier()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)


@old_torch_refuses
def test_monitored_barrier_names_the_missing_rank():
    """Gloo's contract: rank 0 names who did not arrive, the ranks that did
    arrive say they were not released, and the group stays usable."""
    import datetime
    r, n = rank_size()
    t = datetime.timedelta(seconds=1)
    if r == 0:
        with pytest.raises(RuntimeError, match="Rank 1 failed to pass monitoredBarrier in 1000 ms"):
            dist.monitored_barrier(timeout=t)
    elif r != 1:
        with pytest.raises(RuntimeError, match=f"Rank {r} successfully reached monitoredBarrier"):
            dist.monitored_barrier(timeout=t)
    dist.barrier()
    if r == 0:  # nobody else comes: every missing rank named
        want = "Ranks 1, 2 failed" if n == 3 else "Rank 1 failed"
        with pytest.raises(RuntimeError, match=want):
            dist.monitored_barrier(timeout=t, wait_all_ranks=True)
    dist.barrier()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))  # and it passes again
    x = torch.ones(3)
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((3,), float(n)))
    if r == 0:  # no time at all: the caller itself timed out
        with pytest.raises(RuntimeError, match="Rank 0 timed out in monitoredBarrier after 0 ms"):
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=0))


@pytest.mark.parametrize("op", ["SUM", "AVG"])
def test_coalesced_large_tensors_go_direct(op):
    """Tensors averaging >= 64 KB travel one MPI call each, straight between
    the caller's tensors (no packing): same results, an empty one, mixed
    dtypes, non-contiguous inputs and outputs included."""
    r, n = rank_size()
    specs = [((n * 20011,), torch.float32), ((n * 3, 4099), torch.float64), ((0,), torch.float32),
             ((n * 30000,), torch.float32)]
    inputs = [data(r, s, d) for s, d in specs]
    inputs[1] = noncontig(inputs[1])
    outs = [torch.empty(s[0] // n if len(s) == 1 else (s[0] // n, s[1]), dtype=d)
            for s, d in specs]
    outs[3] = torch.empty(n * 0 + specs[3][0][0] // n, 2)[:, 1]  # non-contiguous output
    with _coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, inputs):
            dist.reduce_scatter_tensor(o, i, op=getattr(dist.ReduceOp, op))
    cm.wait()
    for (s, d), o in zip(specs, outs):
        total = sum(data(k, s, d) for k in range(n))
        want = (total / n if op == "AVG" else total).chunk(n)[r] if s[0] else data(0, s, d)
        assert torch.allclose(o, want.to(o.dtype), rtol=1e-6), (s, d)
    gathered = [torch.empty((n * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype) for t in outs]
    gathered[0] = torch.empty(gathered[0].numel(), 3)[:, 2]  # non-contiguous output
    with _coalescing_manager(async_ops=True) as cm:
        for g, t in zip(gathered, outs):
            dist.all_gather_into_tensor(g, t)
    cm.wait()
    for g, t in zip(gathered, outs):
        peers = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(peers, t.contiguous())
        assert torch.equal(g, torch.cat(peers)), g.shape
