"""ddpx._C, the direct entry eager calls of ddpx.ops.tiled_conv2d and
ddpx.nn.TiledConv2d take (plugin/python/fast_ops.cpp): the same op as
torch.ops.ddpx.tiled_conv2d, less torch.ops' Python argument matching.

Checked here: which calls take it (eager plain tensors) and which keep
torch.ops (TorchScript, torch.compile, FX tracing, __torch_function__ modes
and subclasses), that both give the same outputs, gradients and dispatched
ops, its argument errors, and that everything works without it.
"""
import importlib.util
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

if importlib.util.find_spec("ddpx") is None:  # a source tree: the package is not installed
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "plugin", "python"))
import ddpx  # noqa: E402  (reuses the libddpx.so conftest loaded)
from ddpx.nn import TiledConv2d  # noqa: E402

torch.set_num_threads(1)


class CountingC:
    """Stands in for ddpx._C: counts the calls and forwards them to it."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def tiled_conv2d(self, *args):
        self.calls += 1
        return self.real.tiled_conv2d(*args)


@pytest.fixture
def counted(monkeypatch):
    c = CountingC(sys.modules["ddpx._C"])
    monkeypatch.setattr(ddpx.ops, "_C", c)
    return c


def test_the_library_creates_ddpx_C():
    assert "ddpx._C" in sys.modules
    assert ddpx.ops._C is sys.modules["ddpx._C"]


@pytest.mark.parametrize("kw", [{}, {"stride": 2, "padding": 1}, {"padding": (1, 2), "dilation": [2]},
                                {"stride": [2, 1], "padding": 1, "groups": 2}])
def test_eager_calls_take_it_and_equal_torch_ops(counted, kw):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 9, 8, requires_grad=True)
    w = torch.randn(6, 4 // kw.get("groups", 1), 3, 3, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    y = ddpx.ops.tiled_conv2d(x, w, b, **kw)
    assert counted.calls == 1
    go = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w, b), go)

    def pair(v):
        return [v, v] if isinstance(v, int) else list(v) * (2 if len(v) == 1 else 1)

    want_y = torch.ops.ddpx.tiled_conv2d(x, w, b, pair(kw.get("stride", 1)),
                                         pair(kw.get("padding", 0)), pair(kw.get("dilation", 1)),
                                         kw.get("groups", 1))
    assert_close(y, want_y, rtol=0, atol=0)
    for g, wg in zip(got, torch.autograd.grad(want_y, (x, w, b), go)):
        assert_close(g, wg, rtol=0, atol=0)
    assert_close(y, F.conv2d(x, w, b, **kw), rtol=1e-4, atol=1e-5)


def test_module_calls_take_it(counted):
    torch.manual_seed(1)
    for kwargs, shape, via_c in (({"padding": 1}, (2, 3, 7, 7), True),
                                 ({"padding": 1}, (3, 7, 7), True),  # unbatched as it is
                                 ({"padding": "same", "bias": False}, (1, 3, 6, 6), True),
                                 # an F.pad first (reflect): the op after it, through torch.ops
                                 ({"padding": 1, "padding_mode": "reflect"}, (2, 3, 7, 7),
                                  False)):
        ref = torch.nn.Conv2d(3, 5, 3, **kwargs)
        ours = TiledConv2d(3, 5, 3, **kwargs)
        ours.load_state_dict(ref.state_dict())
        before = counted.calls
        x = torch.randn(*shape)
        assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
        assert counted.calls - before == int(via_c), kwargs


def test_script_compile_and_fx_keep_torch_ops(counted):
    torch.manual_seed(2)
    conv = TiledConv2d(2, 3, 3, padding=1)
    x = torch.randn(1, 2, 5, 5)
    want = conv(x)
    counted.calls = 0

    scripted = torch.jit.script(conv)
    assert "ddpx.tiled_conv2d" in scripted._conv_forward.code
    assert_close(scripted(x), want)

    traced = torch.fx.symbolic_trace(conv)
    assert any(n.target is torch.ops.ddpx.tiled_conv2d or
               getattr(n.target, "overloadpacket", None) is torch.ops.ddpx.tiled_conv2d
               for n in traced.graph.nodes), traced.graph
    assert_close(traced(x), want)
    calls_in_fx = counted.calls  # the traced module calls the op itself, not ddpx.ops
    padded = TiledConv2d(2, 3, 3, padding=1, padding_mode="reflect")
    assert_close(torch.fx.symbolic_trace(padded)(x), padded(x))

    torch._dynamo.reset()
    compiled = torch.compile(conv, backend="eager", fullgraph=True)
    assert_close(compiled(x), want)
    assert counted.calls == calls_in_fx == 0


def test_jit_trace_records_the_op_through_it(counted):
    conv = TiledConv2d(2, 3, 3)
    x = torch.randn(1, 2, 5, 5)
    traced = torch.jit.trace(conv, x)
    assert counted.calls >= 1
    assert "ddpx::tiled_conv2d" in str(traced.graph)
    assert_close(traced(x), conv(x))


def test_torch_function_modes_and_subclasses_keep_torch_ops(counted):
    seen = []

    class Log(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    with Log():
        ddpx.ops.tiled_conv2d(x, w)
    assert counted.calls == 0
    assert any("ddpx.tiled_conv2d" in str(f) for f in seen), seen

    class Sub(torch.Tensor):
        pass

    y = ddpx.ops.tiled_conv2d(x.as_subclass(Sub), w)
    assert counted.calls == 0 and type(y) is Sub
    assert_close(y.as_subclass(torch.Tensor), F.conv2d(x, w))


def test_dispatch_modes_see_the_same_ops_either_way(counted):
    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, requires_grad=True)
    fast, slow = Log(), Log()
    with fast:
        torch.autograd.grad(ddpx.ops.tiled_conv2d(x, w, None, 1, 1).sum(), (x, w))
    assert counted.calls == 1
    with slow:
        torch.autograd.grad(
            torch.ops.ddpx.tiled_conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 1).sum(), (x, w))
    assert fast.ops == slow.ops and fast.ops


def test_argument_errors_name_the_argument():
    C = sys.modules["ddpx._C"]
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    with pytest.raises(TypeError, match="input must be a Tensor, got list"):
        C.tiled_conv2d([1.0], w, None, 1, 0, 1, 1)
    with pytest.raises(TypeError, match="bias must be a Tensor, got float"):
        C.tiled_conv2d(x, w, 1.0, 1, 0, 1, 1)
    with pytest.raises(TypeError, match="groups must be an int, got bool"):
        C.tiled_conv2d(x, w, None, 1, 0, 1, True)
    with pytest.raises(TypeError, match="dilation must be an int or 2 ints, got str"):
        C.tiled_conv2d(x, w, None, 1, 0, "2", 1)
    with pytest.raises(TypeError, match="stride must be an int, got float"):
        C.tiled_conv2d(x, w, None, (1, 1.5), 0, 1, 1)
    with pytest.raises(ValueError, match=r"padding must be an int or 2 ints, got \(\)"):
        C.tiled_conv2d(x, w, None, 1, (), 1, 1)
    # What the op itself checks comes back as it does through torch.ops.
    with pytest.raises(RuntimeError, match="stride must be positive"):
        C.tiled_conv2d(x, w, None, 0, 0, 1, 1)
    with pytest.raises(RuntimeError, match="input channels"):
        ddpx.ops.tiled_conv2d(x, w, groups=3)


def test_without_it_calls_take_torch_ops(monkeypatch):
    monkeypatch.setattr(ddpx.ops, "_C", None)
    torch.manual_seed(3)
    conv = TiledConv2d(2, 3, 3, padding=1)
    x = torch.randn(2, 2, 6, 6)
    assert_close(conv(x), F.conv2d(x, conv.weight, conv.bias, padding=1), rtol=1e-5, atol=1e-5)
    assert_close(ddpx.ops.tiled_conv2d(x, conv.weight, stride=2),
                 F.conv2d(x, conv.weight, stride=2), rtol=1e-5, atol=1e-5)
