"""tiled_conv2d and fused_gru under torch.autocast on CUDA (label gpu): cast
to autocast's dtype as F.conv2d is, layers chain (a bfloat16 output feeds
the next layer), and the results match ATen's (F.conv2d under the same
autocast; nn.GRU in bfloat16 outside it, since ATen's autocast runs cuDNN's
RNN in float16 whatever the dtype asked). `ddpx-train --amp bf16` failed on the second convolution before the
Autocast kernels existed (H200, 2026-11-28)."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugin" / "python"))
from conftest import needs_cuda  # noqa: E402
from ddpx.nn import FusedGRU, TiledConv2d  # noqa: E402  (loads the ops)

pytestmark = needs_cuda


@pytest.mark.parametrize("lower", [torch.bfloat16, torch.float16])
def test_conv_layers_chain_under_cuda_autocast(lower):
    torch.manual_seed(0)
    convs = [TiledConv2d(1, 6, 5).cuda(), TiledConv2d(6, 16, 5).cuda()]
    x = torch.randn(8, 1, 28, 28, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=lower):
        ours = convs[1](F.max_pool2d(torch.relu(convs[0](x)), 2))
        ref = F.conv2d(F.max_pool2d(torch.relu(F.conv2d(x, convs[0].weight, convs[0].bias)), 2),
                       convs[1].weight, convs[1].bias)
    assert ours.dtype == ref.dtype == lower
    tol = 2e-2 if lower == torch.bfloat16 else 2e-3
    torch.testing.assert_close(ours.float(), ref.float(), rtol=tol, atol=tol)
    ours.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    assert convs[0].weight.grad.dtype == torch.float32


def test_gru_under_cuda_autocast():
    torch.manual_seed(1)
    ours = FusedGRU(5, 16, num_layers=2, batch_first=True).cuda()
    ref = torch.nn.GRU(5, 16, num_layers=2, batch_first=True).cuda()
    ref.load_state_dict(ours.state_dict())
    s = torch.randn(4, 9, 5, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, h = ours(s)
    want_out, want_h = ref.bfloat16()(s.bfloat16())
    assert out.dtype == h.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h.float(), want_h.float(), rtol=2e-2, atol=2e-2)


def test_double_stays_double_under_cuda_autocast():
    torch.manual_seed(2)
    m = TiledConv2d(3, 4, 3).cuda().double()
    x = torch.randn(2, 3, 9, 9, device="cuda", dtype=torch.double)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = m(x)
    assert got.dtype == torch.double and torch.equal(got, m(x))
