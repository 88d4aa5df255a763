"""ddpx_mpi through torch.distributed with a stock wheel, as a user runs it:
`mpirun -np N python -m pytest tests/python/test_mpi_torch_distributed.py`.
The plugin is loaded by conftest.py (torch.ops.load_library)."""
import datetime
import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module", autouse=True)
def world():
    assert "MASTER_ADDR" not in os.environ, "the point is that mpirun alone is enough"
    dist.init_process_group(backend="ddpx_mpi")
    yield
    dist.destroy_process_group()


def rank_size():
    return dist.get_rank(), dist.get_world_size()


# torch 2.11 splits only a default group bound to an accelerator
# (init_process_group's device_id must be one); 2.15 splits CPU groups.
needs_cpu_split = pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < "2.15",
    reason=f"torch {torch.__version__}'s split_group needs a default group bound to an "
           "accelerator; 2.15 splits CPU groups")


def test_backend_is_ddpx_mpi_and_rank_from_mpi():
    r, n = rank_size()
    assert dist.get_backend() == "ddpx_mpi"
    assert r == int(os.environ["OMPI_COMM_WORLD_RANK"])
    assert n == int(os.environ["OMPI_COMM_WORLD_SIZE"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int8, torch.uint8, torch.int32, torch.int64])
@pytest.mark.parametrize("op", ["SUM", "MIN", "MAX", "PRODUCT"])
def test_all_reduce(dtype, op):
    r, n = rank_size()
    vals = [1 + (torch.arange(13) + k) % 3 for k in range(n)]
    t = vals[r].to(dtype, copy=True)  # the reference below must not alias it
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    stack = torch.stack(vals).double()
    want = {"SUM": stack.sum(0), "MIN": stack.min(0).values, "MAX": stack.max(0).values,
            "PRODUCT": stack.prod(0)}[op]
    assert torch.equal(t.double(), want)


def test_all_reduce_avg_and_async():
    r, n = rank_size()
    t = torch.full((1000,), float(r))
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    work.wait()
    assert torch.allclose(t, torch.full((1000,), (n - 1) / 2))
    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    assert torch.equal(fut.wait()[0], torch.full((4,), float(n)))


def test_complex_sum_as_real_pairs():
    r, n = rank_size()
    t = torch.full((3,), complex(r, 1), dtype=torch.complex64)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), complex(n * (n - 1) / 2, n), dtype=torch.complex64))


def test_broadcast_all_gather_gather_scatter():
    r, n = rank_size()
    t = torch.arange(5.0) if r == n - 1 else torch.zeros(5)
    dist.broadcast(t, src=n - 1)
    assert torch.equal(t, torch.arange(5.0))
    out = [torch.empty(3, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(out, torch.full((3,), r, dtype=torch.int64))
    assert [o[0].item() for o in out] == list(range(n))
    flat = torch.empty(3 * n)
    dist.all_gather_into_tensor(flat, torch.full((3,), float(r)))
    assert torch.equal(flat, torch.arange(n).float().repeat_interleave(3))
    g = [torch.empty(2) for _ in range(n)] if r == 0 else None
    dist.gather(torch.full((2,), float(r)), gather_list=g, dst=0)
    if r == 0:
        assert [x[0].item() for x in g] == list(range(n))
    s = torch.empty(2)
    dist.scatter(s, scatter_list=[torch.full((2,), 10.0 * i) for i in range(n)] if r == 0 else None,
                 src=0)
    assert torch.equal(s, torch.full((2,), 10.0 * r))


def test_reduce_scatter_and_all_to_all():
    r, n = rank_size()
    out = torch.empty(4)
    dist.reduce_scatter_tensor(out, torch.arange(4.0 * n))
    assert torch.equal(out, n * torch.arange(4.0 * r, 4.0 * r + 4))
    inp = torch.arange(n, dtype=torch.float32) + 100 * r
    res = torch.empty(n)
    dist.all_to_all_single(res, inp)
    assert torch.equal(res, torch.arange(n).float() * 100 + r)


def test_send_recv_and_object_collectives():
    r, n = rank_size()
    if r == 0:
        for peer in range(1, n):
            dist.send(torch.full((4,), float(peer)), dst=peer)
    else:
        t = torch.empty(4)
        dist.recv(t, src=0)
        assert torch.equal(t, torch.full((4,), float(r)))
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r})
    assert [o["rank"] for o in objs] == list(range(n))
    dist.barrier()


def test_new_group_subset():
    r, n = rank_size()
    ranks = list(range(0, n, 2))
    g = dist.new_group(ranks=ranks, backend="ddpx_mpi")
    if r in ranks:
        t = torch.ones(3)
        dist.all_reduce(t, group=g)
        assert torch.equal(t, torch.full((3,), float(len(ranks))))
    dist.barrier()


def test_errors_are_clear():
    r, n = rank_size()
    with pytest.raises(RuntimeError, match="AVG needs a floating-point tensor"):
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG)
    with pytest.raises(RuntimeError, match="not supported"):
        dist.all_reduce(torch.ones(2, dtype=torch.uint16))
    with pytest.raises(RuntimeError, match="ranks disagree on allreduce"):
        dist.all_reduce(torch.ones(3 + r))
    t = torch.ones(2)
    dist.all_reduce(t)  # still usable
    assert torch.equal(t, torch.full((2,), float(n)))


def _reversed_parity_groups(n):
    """Evens and odds, each in descending order: the new ranks must follow
    the order given, not the parent's."""
    return [g for g in ([k for k in range(n) if k % 2 == 0][::-1],
                        [k for k in range(n) if k % 2 == 1][::-1]) if g]


@needs_cpu_split
def test_split_group_collectives_match_reference():
    r, n = rank_size()
    assert dist.distributed_c10d._get_default_group()._get_backend(
        torch.device("cpu")).supports_splitting
    splits = _reversed_parity_groups(n)
    pg = dist.split_group(split_ranks=splits)
    mine = next(g for g in splits if r in g)
    assert pg is not None and pg != dist.GroupMember.NON_GROUP_MEMBER
    assert dist.get_world_size(pg) == len(mine)
    assert dist.get_rank(pg) == mine.index(r)
    t = torch.full((5,), float(r + 1))
    dist.all_reduce(t, group=pg)
    assert torch.equal(t, torch.full((5,), float(sum(k + 1 for k in mine))))
    out = [torch.empty(3) for _ in mine]
    dist.all_gather(out, torch.full((3,), float(r)), group=pg)
    assert [int(o[0]) for o in out] == mine  # gathered in the new rank order
    b = torch.full((2,), float(r))
    dist.broadcast(b, src=mine[0], group=pg)
    assert torch.equal(b, torch.full((2,), float(mine[0])))
    dist.destroy_process_group(pg)
    dist.barrier()


@needs_cpu_split
def test_split_group_non_members_get_no_group():
    r, n = rank_size()
    pg = dist.split_group(split_ranks=[[1, 0]])
    if r > 1:
        assert pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER
    else:
        assert dist.get_rank(pg) == 1 - r
        t = torch.tensor([float(10 ** r)])
        dist.all_reduce(t, group=pg)
        assert t.item() == 11.0
        dist.destroy_process_group(pg)
    dist.barrier()


@needs_cpu_split
def test_split_group_bad_rank_is_an_error_on_every_rank():
    _, n = rank_size()
    with pytest.raises(Exception, match=r"split\(\) ranks entry"):
        dist.split_group(split_ranks=[[0, n + 4]])
    dist.barrier()  # the world still works


@pytest.mark.skipif(not hasattr(torch._C._distributed_c10d.Backend, "get_error"),
                    reason=f"torch {torch.__version__}'s Backend has no get_error (2.15 has)")
def test_error_state():
    pg = dist.new_group()
    assert pg._get_backend(torch.device("cpu")).get_error() == \
        torch._C._distributed_c10d.ErrorType.SUCCESS
    dist.destroy_process_group(pg)


def test_collectives_timing():
    pg = dist.new_group()  # its own group: the default one stays untimed
    w = dist.all_reduce(torch.ones(4), group=pg, async_op=True)
    w.wait()
    with pytest.raises(RuntimeError, match="collective timing"):
        w._get_duration()
    pg._enable_collectives_timing()
    w = dist.all_reduce(torch.ones(1 << 18), group=pg, async_op=True)
    w.wait()
    assert 0.0 < w._get_duration() < 60_000.0
    dist.destroy_process_group(pg)


def test_merge_remote_group_ranks_in_store_order():
    """ProcessGroup.merge_remote_group (Gloo implements it; torch's fault
    tolerance uses it): the processes that meet on one store become a group,
    ranked in the order the store hands out."""
    r, n = rank_size()
    store = dist.PrefixStore("merge-test", dist.distributed_c10d._get_default_store())
    pg = dist.distributed_c10d._get_default_group()
    merged = pg.merge_remote_group(store, n, datetime.timedelta(seconds=60))
    ranks = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    merged.allgather([ranks], [torch.tensor([r])]).wait()
    assert sorted(int(t) for t in ranks) == list(range(n))
    assert int(ranks[merged.rank()]) == r  # the merged rank is this process's slot
    t = torch.tensor([float(r + 1)])
    merged.allreduce([t]).wait()
    assert t.item() == n * (n + 1) / 2
    dist.barrier()


@pytest.mark.skipif(not hasattr(torch._C._distributed_c10d, "ReconfigureOptions"),
                    reason=f"torch {torch.__version__} has no Backend.reconfigure (2.15 has)")
def test_reconfigure_rebuilds_the_group_among_handles():
    """Backend.reconfigure (Gloo implements it; torch's fault tolerance uses
    it): the members named by their handles form the group again, in the
    list's order; the others keep theirs; a bad handle is an error naming it."""
    r, n = rank_size()
    pg = dist.new_group()  # its own group: the default one stays as it is
    b = pg._get_backend(torch.device("cpu"))
    assert b.supports_reconfigure
    handles = [None] * n
    dist.all_gather_object(handles, b.get_reconfigure_handle())
    members = [handles[1], handles[0]]  # ranks 0 and 1, swapped
    opts = torch._C._distributed_c10d.ReconfigureOptions()
    opts.uuid = 4242
    opts.handles = members
    if r < 2:
        b.reconfigure(opts).wait()
        assert (b.rank(), b.size()) == (1 - r, 2)
        t = torch.tensor([float(10 ** r)])
        b.allreduce([t]).wait()
        assert t.item() == 11.0
    bad = torch._C._distributed_c10d.ReconfigureOptions()
    bad.uuid = 4243
    bad.handles = ["another-job:0"]
    with pytest.raises(RuntimeError, match="another MPI job"):
        b.reconfigure(bad)
    dist.barrier()
