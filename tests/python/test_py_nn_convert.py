"""ddpx.nn.convert / revert on small ResNet-like and HAN-like models, and
ddpx.nn's modules through torch.jit.script (+ save/load), torch.jit.trace,
torch.compile and torch.export (CPU).

Tolerances (float32): a converted model against the unconverted one runs other
kernels (summation order only): outputs rtol 1e-5 / atol 1e-5, gradients
rtol 1e-4 / atol 1e-4. Scripted, traced, compiled and exported runs call the
very same op as eager: rtol 1e-6 / atol 1e-6.
"""
import copy
import importlib.util
import os
import pickle
import sys
import zipfile

import pytest
import torch
from torch import nn
from torch.testing import assert_close

if importlib.util.find_spec("ddpx") is None:  # a source tree: the package is not installed
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "plugin", "python"))
import ddpx.nn  # noqa: E402  (reuses the libddpx.so conftest loaded)
from ddpx.nn import FusedGRU, TiledConv2d  # noqa: E402

FWD_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)
SAME_OP_TOL = dict(rtol=1e-6, atol=1e-6)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script/trace/load
torch.set_num_threads(1)


class Block(nn.Module):
    """A ResNet basic block with a grouped second conv and a 1x1 downsample."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, groups=2, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                  nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.down(x))


class ResNetLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = Block(8, 16, stride=2)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):  # [N, 3, H, W] -> [N, 5]
        return self.fc(self.block(self.stem(x)).mean(dim=(2, 3)))


class HANLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(50, 8)
        self.gru = nn.GRU(8, 6, num_layers=2, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(12, 3)

    def forward(self, tokens):  # [N, T] int64 -> [N, 3]
        h, _ = self.gru(self.embedding(tokens))
        return self.fc(h.mean(dim=1))


def make_input(model):
    g = torch.Generator().manual_seed(2)
    if isinstance(model, HANLike):
        return torch.randint(0, 50, (4, 7), generator=g)
    return torch.randn(4, 3, 11, 10, generator=g)


def forward_backward(model, x, owner=None):
    """model(x) and the gradients of owner's (default: model's) parameters."""
    owner = model if owner is None else owner
    owner.zero_grad()
    out = model(x)
    (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in owner.named_parameters()}


def count(model, cls):
    return sum(type(m) is cls for m in model.modules())


@pytest.mark.parametrize("model_cls,n_conv,n_gru", [(ResNetLike, 4, 0), (HANLike, 0, 1)])
def test_convert_keeps_parameters_and_results(model_cls, n_conv, n_gru):
    torch.manual_seed(0)
    model = model_cls()
    model.fc.eval()  # a mixed training mode, to be kept
    ref = copy.deepcopy(model)
    params = {n: id(p) for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before converting

    assert ddpx.nn.convert(model) is model
    assert (count(model, TiledConv2d), count(model, FusedGRU)) == (n_conv, n_gru)
    assert count(model, nn.Conv2d) == count(model, nn.GRU) == 0
    assert {n: id(p) for n, p in model.named_parameters()} == params
    assert {n: m.training for n, m in model.named_modules()} == modes

    x = make_input(model)
    out, grads = forward_backward(model, x)
    ref_out, ref_grads = forward_backward(ref, x)
    assert_close(out, ref_out, **FWD_TOL)
    for n, g in ref_grads.items():
        assert_close(grads[n], g, **GRAD_TOL, msg=lambda m: f"grad of {n}: {m}")
    opt.step()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for n, p in ref.named_parameters():
        assert_close(dict(model.named_parameters())[n], p, **GRAD_TOL, msg=n)


@pytest.mark.parametrize("model_cls", [ResNetLike, HANLike])
def test_revert_restores_torch_modules(model_cls):
    torch.manual_seed(0)
    model = model_cls()
    ref = copy.deepcopy(model)
    params = [id(p) for p in model.parameters()]
    ddpx.nn.revert(ddpx.nn.convert(model))
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]
    assert [id(p) for p in model.parameters()] == params
    assert not any(hasattr(m, "_op_padding") for m in model.modules())
    # A pickle of the reverted model names no ddpx class: it loads without ddpx.
    assert b"ddpx" not in pickle.dumps(model)
    x = make_input(model)
    assert_close(model(x), ref(x), rtol=0, atol=0)


def test_convert_root_and_scope():
    """A root layer is converted itself; subclasses of nn.Conv2d are left alone."""
    conv = nn.Conv2d(2, 3, 3, padding="same", padding_mode="reflect")
    assert type(ddpx.nn.convert(conv)) is TiledConv2d
    x = torch.randn(1, 2, 6, 5)
    assert_close(conv(x), ddpx.nn.revert(copy.deepcopy(conv))(x), **FWD_TOL)

    class MyConv(nn.Conv2d):
        pass

    model = nn.Sequential(MyConv(2, 3, 1), nn.GRU(3, 4), nn.LSTM(3, 4))
    ddpx.nn.convert(model)
    assert [type(m) for m in model] == [MyConv, FusedGRU, nn.LSTM]


def saved_code(path):
    """The TorchScript source of every method in a saved module."""
    with zipfile.ZipFile(path) as z:
        return "".join(z.read(n).decode() for n in z.namelist() if n.endswith(".py"))


def script_round_trip(module, tmp_path):
    path = tmp_path / "m.pt"
    torch.jit.script(module).save(str(path))
    return torch.jit.load(str(path)), saved_code(path)


@pytest.mark.parametrize("which", ["conv", "gru", "resnet", "han"])
def test_script_save_load(which, tmp_path):
    torch.manual_seed(0)
    if which == "conv":
        model = TiledConv2d(3, 4, 4, padding="same", padding_mode="circular").eval()
        x, op = torch.randn(2, 3, 7, 9), "ops.ddpx.tiled_conv2d"
    elif which == "gru":
        model = FusedGRU(3, 5, 2, bidirectional=True).eval()
        x, op = torch.randn(6, 2, 3), "ops.ddpx.fused_gru"
    else:
        model = ddpx.nn.convert(ResNetLike() if which == "resnet" else HANLike()).eval()
        x = make_input(model)
        op = "ops.ddpx.tiled_conv2d" if which == "resnet" else "ops.ddpx.fused_gru"
    loaded, code = script_round_trip(model, tmp_path)
    assert op in code
    assert "torch.gru(" not in code and "torch.conv2d(" not in code
    for a, b in zip(_flat(loaded(x)), _flat(model(x))):
        assert_close(a, b, **SAME_OP_TOL)


def _flat(out):
    return out if isinstance(out, tuple) else (out,)


def test_scripted_gru_reads_parameters_on_every_call(tmp_path):
    """The scripted list is built from the attributes: a parameter replaced
    after scripting is used (a scripted nn.GRU keeps its old _flat_weights)."""
    torch.manual_seed(0)
    eager = FusedGRU(3, 4, 2, batch_first=True)
    gru, _ = script_round_trip(eager, tmp_path)
    new = nn.Parameter(torch.randn(12, 4))
    gru.weight_hh_l1 = new
    eager.weight_hh_l1 = new
    x = torch.randn(2, 5, 3)
    for a, b in zip(gru(x), eager(x)):
        assert_close(a, b, **SAME_OP_TOL)
    gru.double()
    out, h = gru(x.double())
    assert out.dtype == h.dtype == torch.float64


def test_script_errors_name_the_argument():
    with pytest.raises(ValueError, match="num_layers <= 4, got 5"):
        torch.jit.script(FusedGRU(3, 4, 5))
    conv = torch.jit.script(TiledConv2d(3, 4, 3))
    with pytest.raises(torch.jit.Error, match="input must be 4-D .* got 2-D"):
        conv(torch.randn(3, 8))
    gru = torch.jit.script(FusedGRU(3, 4))
    with pytest.raises(torch.jit.Error, match="input must be 3-D .* got 1-D"):
        gru(torch.randn(3))


def test_trace():
    torch.manual_seed(0)
    conv = TiledConv2d(3, 4, 3, stride=2, padding=1, groups=1)
    x = torch.randn(2, 3, 8, 9)
    traced = torch.jit.trace(conv, (x,))
    assert "ddpx::tiled_conv2d" in str(traced.graph)
    assert_close(traced(x), conv(x), **SAME_OP_TOL)
    gru = FusedGRU(3, 4, 2, batch_first=True).eval()
    xg = torch.randn(2, 5, 3)
    traced = torch.jit.trace(gru, (xg,))
    assert "ddpx::fused_gru" in str(traced.graph)
    for a, b in zip(traced(xg), gru(xg)):
        assert_close(a, b, **SAME_OP_TOL)


def compile_matches_eager(module, x, **compile_kw):
    torch._dynamo.reset()  # dynamo caches per code object: start each case afresh
    compiled = torch.compile(module, backend="aot_eager", **compile_kw)
    out, grads = forward_backward(compiled, x, owner=module)
    ref_out, ref_grads = forward_backward(module, x)
    assert_close(out, ref_out, **SAME_OP_TOL)
    for n, g in ref_grads.items():
        assert_close(grads[n], g, **SAME_OP_TOL, msg=n)


needs_compile = pytest.mark.skipif(not hasattr(torch, "compile"),
                                   reason="this torch has no torch.compile")


@needs_compile
def test_compile_conv_fullgraph():
    torch.manual_seed(0)
    model = nn.Sequential(TiledConv2d(3, 4, 4, padding="same", padding_mode="reflect"), nn.ReLU(),
                          TiledConv2d(4, 2, 3, stride=2, groups=2))
    compile_matches_eager(model, torch.randn(2, 3, 9, 8), fullgraph=True)


@needs_compile
@pytest.mark.parametrize("allow_rnn", [False, True])
def test_compile_gru(allow_rnn):
    """Dynamo breaks the graph at every nn.GRU (FusedGRU included) unless
    allow_rnn; either way the result is eager's, and with allow_rnn the
    whole model is one graph."""
    torch.manual_seed(0)
    model = ddpx.nn.convert(HANLike())
    with torch._dynamo.config.patch(allow_rnn=allow_rnn):
        compile_matches_eager(model, make_input(model), fullgraph=allow_rnn)


def test_export():
    torch.manual_seed(0)
    model = nn.Sequential(TiledConv2d(3, 4, (2, 3), padding="same"), nn.ReLU(),
                          TiledConv2d(4, 4, 3, padding=1, padding_mode="replicate", groups=4))
    x = torch.randn(2, 3, 7, 8)
    ep = torch.export.export(model, (x,))
    assert "ddpx.tiled_conv2d" in ep.graph_module.code
    assert_close(ep.module()(x), model(x), **SAME_OP_TOL)
    gru = FusedGRU(3, 4, bidirectional=True, batch_first=True).eval()
    xg = torch.randn(2, 5, 3)
    ep = torch.export.export(gru, (xg,))
    assert "ddpx.fused_gru" in ep.graph_module.code
    for a, b in zip(ep.module()(xg), gru(xg)):
        assert_close(a, b, **SAME_OP_TOL)
