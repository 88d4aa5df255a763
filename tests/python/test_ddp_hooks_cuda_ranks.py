"""Issue 60 on a GPU (label gpu, 2 ranks sharing the one GPU under mpirun):
ddpx.distributed's hooks on a CUDA DDP model over the backends that reduce
host memory (ddpx_mpi, Gloo). The codec runs on the state's worker thread and
a CUDA stream of its own, after backward's stream, and DDP's stream waits for
its result: `none` gives DDP's own parameters bit for bit (x/2 is exact on two
ranks), fp16 and int8 stay within their rounding of them. The op's `none` on
a CUDA tensor (staged through pinned host memory in 4 MiB chunks) equals the
same call on the CPU bit for bit. A CUDA call's Future and a recv follow the
caller's stream."""
import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import needs_cuda

import ddpx  # noqa: F401  (the ops and ddpx_mpi)
from ddpx.distributed import CodecState, codec_hook

pytestmark = needs_cuda
DEVICE = "cuda"
BATCH = 4  # per rank


def train(group, state=None, steps=4):
    """Parameters after `steps` of SGD under DDP (with codec_hook on `state`)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(40, 96), torch.nn.Tanh(),
                            torch.nn.Linear(96, 64), torch.nn.Tanh(),
                            torch.nn.Linear(64, 5)).to(DEVICE)
    ddp = DDP(m, process_group=group, bucket_cap_mb=0.02)
    if state is not None:
        ddp.register_comm_hook(state, codec_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(BATCH * world, 40, generator=g), torch.randn(BATCH * world, 5, generator=g)
        x, y = x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x.to(DEVICE)), y.to(DEVICE)).backward()
        opt.step()
    return [p.detach().cpu() for p in m.parameters()]


def test_hooks_on_cuda_buckets_run_off_backward(group, monkeypatch):
    threads = set()
    packed = torch.ops.ddpx.compressed_allreduce_packed

    def spy(flat, *args):
        # Where the codec ran, and on which stream: not backward's thread or
        # its (default) stream.
        threads.add(threading.current_thread().name)
        if flat.is_cuda:
            assert torch.cuda.current_stream(flat.device) != torch.cuda.default_stream(flat.device)
        return packed(flat, *args)

    monkeypatch.setattr(torch.ops.ddpx, "compressed_allreduce_packed", spy)
    exact = train(group)
    state = CodecState("none", process_group=group)
    for a, b in zip(train(group, state), exact):
        assert torch.equal(a, b)
    assert threads == {"ddpx-comm-hook"}
    for codec, atol in [("fp16", 2e-3), ("int8", 1e-2)]:
        state = CodecState(codec, process_group=group)
        got = train(group, state)
        assert state.stats()["calls"] >= 4, codec
        for a, b in zip(got, exact):
            torch.testing.assert_close(a, b, rtol=0, atol=atol)


def test_none_staged_equals_the_cpu(group):
    # float32 of 4 MiB and 24 bytes: a whole chunk, then 6 elements; float64
    # of 10 MiB: two chunks and a half.
    name = (group if group is not None else dist.group.WORLD).group_name
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    flat = [torch.randn(1_048_577 + 5, generator=g),
            torch.randn(1_310_720, generator=g, dtype=torch.float64)]
    rows = torch.randn(300, 7, generator=g)
    pairs = [(x, x.to(DEVICE)) for x in flat]
    # Non-contiguous on the device, one chunk (sliced after the move: .to()
    # of a non-dense tensor makes it contiguous).
    pairs.append((rows[:, ::2], rows.to(DEVICE)[:, ::2]))
    for x, on_device in pairs:
        assert on_device.is_contiguous() == x.is_contiguous()
        want = torch.ops.ddpx.compressed_allreduce(x, "none", "", name)
        got = torch.ops.ddpx.compressed_allreduce(on_device, "none", "", name)
        assert got.device.type == DEVICE and got.shape == x.shape
        assert torch.equal(got.cpu(), want)


def _busy(stream, ms=200):
    """Keeps `stream` busy for about `ms` (work queued behind it waits)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(ms * 2_000_000)  # cycles, at about 2 GHz


def test_future_callbacks_follow_the_callers_stream(group):
    """A CUDA collective's Future is one of its devices (as Gloo's): a then()
    callback's kernels run on a stream that waits for the result, not on the
    completing thread's default stream (kept busy here), and waiting on the
    chained Future orders the caller's stream after them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    side = torch.cuda.Stream()
    _busy(torch.cuda.default_stream(), 300)
    with torch.cuda.stream(side):
        t = torch.full((1000,), float(rank + 1), device=DEVICE)
        # (The input ready only after this, so the Future is taken before the
        # call completes: its callback then runs on the completing thread.)
        _busy(side, 100)
        fut = dist.all_reduce(t, group=group, async_op=True).get_future()
        got = fut.then(lambda f: f.value()[0] * 2).wait()
        host = torch.empty(got.shape, pin_memory=True)
        host.copy_(got, non_blocking=True)
    side.synchronize()
    assert torch.equal(host, torch.full((1000,), 2.0 * sum(range(1, world + 1))))
    torch.cuda.synchronize()


def test_recv_lands_after_the_callers_stream(mpi_and_gloo):
    """ddpx_mpi's recv into a CUDA tensor copies it back on the caller's
    stream, after what was queued there before the call (a wait, then a
    fill), whenever the message comes in."""
    rank = dist.get_rank()
    if rank == 0:
        dist.send(torch.full((1000,), 3.0, device=DEVICE), dst=1)
    elif rank == 1:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            buf = torch.zeros(1000, device=DEVICE)
            _busy(side)
            buf.fill_(7.0)
            dist.recv(buf, src=0)
            host = torch.empty(1000, pin_memory=True)
            host.copy_(buf, non_blocking=True)
        side.synchronize()
        assert torch.equal(host, torch.full((1000,), 3.0))
    dist.barrier()
