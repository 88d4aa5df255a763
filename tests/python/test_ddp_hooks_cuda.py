"""Issue 44 on a GPU (label gpu): ddpx.distributed's hooks on a CUDA DDP
model over NCCL (world size 1, a FileStore group: one GPU), the codec running
on CUDA tensors on the calling thread. `none` equals DDP bit for bit; int8
within its bound; fp16, topk and powersgd train; the package's ops and
modules on CUDA tensors equal the CPU's."""
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import needs_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugin" / "python"))
import ddpx  # noqa: E402
from ddpx.distributed import CodecState, codec_hook  # noqa: E402

pytestmark = needs_cuda


@pytest.fixture(scope="module")
def nccl(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "file"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def train(hook, state, steps=3):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(40, 96), torch.nn.Tanh(),
                            torch.nn.Linear(96, 5)).cuda()
    ddp = DDP(m, device_ids=[0], bucket_cap_mb=0.01)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 40, generator=g).cuda(), torch.randn(8, 5, generator=g).cuda()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in m.parameters()]


def test_hooks_on_cuda_over_nccl(nccl):
    exact = train(None, None)
    for a, b in zip(train(codec_hook, CodecState("none")), exact):
        assert torch.equal(a, b)
    for codec, atol in [("int8", 1e-2), ("fp16", 2e-3), ("topk:0.5", None), ("powersgd:2", None)]:
        state = CodecState(codec)
        got = train(codec_hook, state)
        assert state.stats()["calls"] >= 3, codec
        for a, b in zip(got, exact):
            assert torch.isfinite(a).all(), codec
            if atol is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=atol)


def test_package_modules_on_cuda():
    torch.manual_seed(2)
    # In double: float32 CUDA calls go to cuDNN, which may use TF32 (its
    # GRU's were 1.8e-4 apart from the CPU on the H200, 2026-11-28).
    conv = ddpx.nn.TiledConv2d(3, 4, 3, padding="same").double()
    x = torch.randn(2, 3, 9, 7, dtype=torch.double)
    torch.testing.assert_close(conv.cuda()(x.cuda()).cpu(), conv.cpu()(x), rtol=1e-9, atol=1e-9)
    gru = ddpx.nn.FusedGRU(5, 6, batch_first=True).double()
    s = torch.randn(2, 4, 5, dtype=torch.double)
    for a, b in zip(gru.cuda()(s.cuda()), gru.cpu()(s)):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-9, atol=1e-9)
