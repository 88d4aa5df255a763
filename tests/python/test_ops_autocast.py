"""tiled_conv2d and fused_gru under torch.autocast on the CPU (their Autocast
kernels, ops/autocast/). Our CPU kernels compute float32 and float64, so
under CPU autocast the ops run in float32 whatever the lower-precision dtype,
and the ATen calls inside them (the aten path serves LeNet's convolutions)
are not cast again: before those kernels existed a second layer got a
bfloat16 input with a float32 weight and failed. CUDA: test_ops_autocast_cuda.py."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugin" / "python"))
from ddpx.nn import FusedGRU, TiledConv2d  # noqa: E402  (loads the ops)


def lenet_convs():
    torch.manual_seed(0)
    return torch.nn.Sequential(TiledConv2d(1, 6, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               TiledConv2d(6, 16, 5), torch.nn.ReLU())


@pytest.mark.parametrize("lower", [torch.bfloat16, torch.float16])
def test_conv_layers_run_float32_under_cpu_autocast(lower):
    m = lenet_convs()
    x = torch.randn(4, 1, 28, 28, requires_grad=True)
    want = m(x)
    want.sum().backward()
    want_grad = x.grad.clone()
    x.grad = None
    with torch.autocast("cpu", dtype=lower):
        got = m(x)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    got.sum().backward()
    assert torch.equal(x.grad, want_grad)


def test_lower_precision_inputs_are_computed_in_float32():
    torch.manual_seed(1)
    x, w, b = torch.randn(2, 3, 9, 8), torch.randn(4, 3, 3, 3), torch.randn(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.ops.ddpx.tiled_conv2d(x.bfloat16(), w, b.bfloat16(), [1, 1], [1, 1], [1, 1], 1)
    want = torch.ops.ddpx.tiled_conv2d(x.bfloat16().float(), w, b.bfloat16().float(),
                                       [1, 1], [1, 1], [1, 1], 1)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # Outside autocast a bfloat16 input is still refused on the CPU, by name.
    with pytest.raises(RuntimeError, match="input dtype BFloat16 is not supported on cpu"):
        torch.ops.ddpx.tiled_conv2d(x.bfloat16(), w.bfloat16(), None, [1, 1], [1, 1], [1, 1], 1)


def test_double_stays_double_under_cpu_autocast():
    m = lenet_convs().double()
    x = torch.randn(2, 1, 28, 28, dtype=torch.double)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m(x)
    assert got.dtype == torch.double and torch.equal(got, m(x))


def test_gru_under_cpu_autocast():
    torch.manual_seed(2)
    gru = FusedGRU(5, 7, num_layers=2, batch_first=True)
    head = torch.nn.Linear(7, 3)
    s = torch.randn(3, 6, 5)
    want_out, want_h = gru(s)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, h = gru(s)
        logits = head(out)  # the ATen layer after it still runs in bfloat16
    assert out.dtype == h.dtype == torch.float32
    assert torch.equal(out, want_out) and torch.equal(h, want_h)
    assert logits.dtype == torch.bfloat16
