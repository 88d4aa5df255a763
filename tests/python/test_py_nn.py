"""ddpx.nn.TiledConv2d and FusedGRU against torch.nn.Conv2d and torch.nn.GRU
with the same weights (CPU): forward, backward, gradcheck, state_dicts and
argument errors. test_py_nn_convert.py covers convert/revert and scripting,
tracing, torch.compile and torch.export.

Tolerances (float32; the ops differ from ATen's only in summation order):
outputs rtol 1e-5 / atol 1e-5; gradients rtol 1e-4 / atol 1e-4 (weight and
bias gradients sum over batch and pixels or time steps, as in
test_tiled_conv2d.py and test_fused_gru.py). gradcheck runs in float64.
"""
import importlib.util
import itertools
import os
import sys

import pytest
import torch
from torch import nn
from torch.testing import assert_close

if importlib.util.find_spec("ddpx") is None:  # a source tree: the package is not installed
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "plugin", "python"))
import ddpx  # noqa: E402,F401  (reuses the libddpx.so conftest loaded)
from ddpx.nn import FusedGRU, TiledConv2d  # noqa: E402

FWD_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)

# nn.Conv2d's note on an asymmetric 'same' (it pads a copy of the input, as we do).
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
torch.set_num_threads(1)  # small problems: intra-op threads only contend on a shared runner


def twins(ref_cls, ours_cls, *args, **kwargs):
    """(torch module, ddpx module) with the same weights: ours loads ref's state_dict."""
    ref = ref_cls(*args, **kwargs)
    ours = ours_cls(*args, **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def run(module, *inputs):
    """Outputs of module(*inputs) (flattened to a tuple of tensors) and the
    gradients of a fixed random projection of them w.r.t. the float inputs
    and every parameter (None where no gradient reached)."""
    inputs = [x.detach().requires_grad_() if x is not None else None for x in inputs]
    out = module(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    leaves = [x for x in inputs if x is not None] + list(module.parameters())
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return outs, grads


def assert_same(ref, ours, *inputs):
    ref_out, ref_grads = run(ref, *inputs)
    our_out, our_grads = run(ours, *inputs)
    for a, b in zip(our_out, ref_out):
        assert a.shape == b.shape
        assert_close(a, b, **FWD_TOL)
    names = [f"input {i}" for i, x in enumerate(inputs) if x is not None]
    names += [n for n, _ in ref.named_parameters()]
    for name, a, b in zip(names, our_grads, ref_grads):
        assert (a is None) == (b is None), name
        if b is not None:
            assert_close(a, b, **GRAD_TOL, msg=lambda m: f"grad of {name}: {m}")


# ---------------------------------------------------------------- TiledConv2d

# (in_channels, out_channels, kernel_size, nn.Conv2d keyword arguments)
CONV_CASES = [
    (3, 4, 1, {}),
    (3, 4, 3, dict(padding=1)),
    (3, 5, 5, dict(padding=2, stride=2)),
    (2, 4, 3, dict(padding=(1, 0), stride=(2, 1))),
    (3, 4, 3, dict(padding="same")),
    (3, 4, 5, dict(padding="same", dilation=2)),
    (3, 4, (2, 5), dict(padding="same")),            # asymmetric: 1 extra row at the bottom
    (2, 3, 4, dict(padding="same", dilation=(1, 2), bias=False)),  # asymmetric in H only
    (3, 4, 3, dict(padding="valid")),
    (3, 4, 3, dict(dilation=2, padding=2)),
    (4, 6, 3, dict(padding=1, groups=2)),
    (4, 4, 3, dict(padding=1, groups=4)),           # depthwise
    (6, 6, 5, dict(padding=2, stride=2, groups=6, bias=False)),
    (3, 4, 3, dict(padding=1, bias=False)),
    (3, 4, 3, dict(padding=1, padding_mode="reflect")),
    (3, 4, 3, dict(padding=(2, 1), padding_mode="replicate", stride=2)),
    (3, 4, 5, dict(padding=2, padding_mode="circular", dilation=1)),
    (3, 4, 4, dict(padding="same", padding_mode="reflect")),
    (2, 4, 3, dict(padding="same", padding_mode="circular", dilation=2, groups=2)),
    (3, 4, 3, dict(padding=0, padding_mode="reflect")),  # nothing to pad
]


def conv_id(case):
    cin, cout, k, kw = case
    return f"{cin}-{cout}-k{k}-" + "-".join(f"{a}={v}" for a, v in kw.items())


@pytest.mark.parametrize("case", CONV_CASES, ids=conv_id)
@pytest.mark.parametrize("hw", [(8, 8), (7, 11)])
def test_conv_matches_nn_conv2d(case, hw):
    cin, cout, k, kw = case
    torch.manual_seed(0)
    ref, ours = twins(nn.Conv2d, TiledConv2d, cin, cout, k, **kw)
    assert_same(ref, ours, torch.randn(2, cin, *hw))


LAYOUTS = {
    "channels_last": lambda x: x.contiguous(memory_format=torch.channels_last),
    "transposed": lambda x: x.transpose(2, 3).contiguous().transpose(2, 3),
    "strided": lambda x: torch.cat([x, x], dim=3)[..., ::2],
    "empty_batch": lambda x: x[:0],
    "unbatched": lambda x: x[1],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", [CONV_CASES[2], CONV_CASES[6], CONV_CASES[11], CONV_CASES[16]],
                         ids=conv_id)
def test_conv_input_layouts(case, layout):
    cin, cout, k, kw = case
    torch.manual_seed(0)
    ref, ours = twins(nn.Conv2d, TiledConv2d, cin, cout, k, **kw)
    x = LAYOUTS[layout](torch.randn(3, cin, 9, 10))
    assert layout in ("empty_batch", "unbatched") or not x.is_contiguous()
    assert_same(ref, ours, x)


@pytest.mark.parametrize("kw", [dict(padding="same", bias=True), dict(
    stride=2, padding=1, padding_mode="reflect", groups=2)], ids=["same", "reflect-stride2"])
def test_conv_gradcheck(kw):
    torch.manual_seed(0)
    conv = TiledConv2d(2, 2, (2, 3), dtype=torch.float64, **kw)
    params = {n: p.detach().requires_grad_() for n, p in conv.named_parameters()}
    x = torch.randn(2, 2, 5, 6, dtype=torch.float64, requires_grad=True)

    def f(x, *values):
        return torch.func.functional_call(conv, dict(zip(params, values)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params.values()))


def test_conv_state_dict_round_trip():
    torch.manual_seed(0)
    ref = nn.Conv2d(3, 6, 3, stride=2, padding="valid", groups=3, padding_mode="zeros")
    ours = TiledConv2d(3, 6, 3, stride=2, padding="valid", groups=3)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ours.load_state_dict(ref.state_dict())
    back = nn.Conv2d(3, 6, 3, stride=2, padding="valid", groups=3)
    back.load_state_dict(ours.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    x = torch.randn(2, 3, 9, 9)
    assert_close(ours(x), back(x), **FWD_TOL)


def test_conv_init_matches_nn_conv2d():
    """Same default initialisation, drawing the same numbers from the generator."""
    torch.manual_seed(5)
    ref = nn.Conv2d(3, 4, 3)
    torch.manual_seed(5)
    ours = TiledConv2d(3, 4, 3)
    assert torch.equal(ours.weight, ref.weight) and torch.equal(ours.bias, ref.bias)


def test_conv_bad_arguments():
    conv = TiledConv2d(3, 4, 3)
    with pytest.raises(ValueError, match="input must be 4-D .* got 5-D"):
        conv(torch.randn(1, 2, 3, 8, 8))
    with pytest.raises(ValueError, match="input must be 4-D .* got 2-D"):
        conv(torch.randn(3, 8))
    # nn.Conv2d's own checks still apply.
    with pytest.raises(ValueError, match="padding='same' is not supported for strided"):
        TiledConv2d(3, 4, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match="padding_mode must be one of"):
        TiledConv2d(3, 4, 3, padding_mode="mirror")


# ------------------------------------------------------------------- FusedGRU

SEQ, BATCH, INPUT, HIDDEN = 5, 3, 4, 6


@pytest.mark.parametrize("layers,bidirectional,batch_first,bias,with_hx", list(
    itertools.product([1, 2], [False, True], [False, True], [True, False], [False, True])))
def test_gru_matches_nn_gru(layers, bidirectional, batch_first, bias, with_hx):
    torch.manual_seed(0)
    ref, ours = twins(nn.GRU, FusedGRU, INPUT, HIDDEN, layers, bias=bias,
                      batch_first=batch_first, bidirectional=bidirectional)
    x = torch.randn(BATCH, SEQ, INPUT) if batch_first else torch.randn(SEQ, BATCH, INPUT)
    hx = torch.randn(layers * (2 if bidirectional else 1), BATCH, HIDDEN) if with_hx else None
    assert_same(ref, ours, x, hx)


@pytest.mark.parametrize("with_hx", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_gru_unbatched(with_hx, batch_first):
    torch.manual_seed(0)
    ref, ours = twins(nn.GRU, FusedGRU, INPUT, HIDDEN, 2, bidirectional=True,
                      batch_first=batch_first)
    hx = torch.randn(4, HIDDEN) if with_hx else None
    assert_same(ref, ours, torch.randn(SEQ, INPUT), hx)


def test_gru_dropout_in_eval_mode_is_identity():
    torch.manual_seed(0)
    ref, ours = twins(nn.GRU, FusedGRU, INPUT, HIDDEN, 3, dropout=0.5, bidirectional=True)
    ref.eval()
    ours.eval()
    assert_same(ref, ours, torch.randn(SEQ, BATCH, INPUT), torch.randn(6, BATCH, HIDDEN))


def test_gru_dropout_in_training_drops():
    """Training with dropout: a different mask each call (the default generator's)."""
    torch.manual_seed(0)
    gru = FusedGRU(INPUT, HIDDEN, 2, dropout=0.5)
    x = torch.randn(SEQ, BATCH, INPUT)
    assert not torch.equal(gru(x)[0], gru(x)[0])
    gru.eval()
    assert torch.equal(gru(x)[0], gru(x)[0])


def test_gru_gradcheck():
    torch.manual_seed(0)
    gru = FusedGRU(2, 3, 2, bidirectional=True, batch_first=True, dtype=torch.float64)
    params = {n: p.detach().requires_grad_() for n, p in gru.named_parameters()}
    x = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    hx = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)

    def f(x, hx, *values):
        return torch.func.functional_call(gru, dict(zip(params, values)), (x, hx))

    assert torch.autograd.gradcheck(f, (x, hx, *params.values()))


def test_gru_state_dict_round_trip():
    torch.manual_seed(0)
    kw = dict(num_layers=2, bidirectional=True, batch_first=True, bias=False)
    ref = nn.GRU(INPUT, HIDDEN, **kw)
    ours = FusedGRU(INPUT, HIDDEN, **kw)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ours.load_state_dict(ref.state_dict())
    back = nn.GRU(INPUT, HIDDEN, **kw)
    back.load_state_dict(ours.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    x = torch.randn(BATCH, SEQ, INPUT)
    for a, b in zip(ours(x), back(x)):
        assert_close(a, b, **FWD_TOL)


def test_gru_reads_parameters_on_every_call():
    """No cached parameter list: replaced or converted parameters are used."""
    torch.manual_seed(0)
    ref, ours = twins(nn.GRU, FusedGRU, INPUT, HIDDEN, 2)
    ours.weight_hh_l1 = nn.Parameter(torch.zeros_like(ours.weight_hh_l1))
    ref.weight_hh_l1 = nn.Parameter(torch.zeros_like(ref.weight_hh_l1))
    x = torch.randn(SEQ, BATCH, INPUT)
    assert_close(ours(x)[0], ref(x)[0], **FWD_TOL)
    ours.double()
    assert ours(x.double())[0].dtype == torch.float64


def test_gru_bad_arguments():
    with pytest.raises(ValueError, match="proj_size must be 0"):
        FusedGRU(INPUT, HIDDEN, proj_size=2)
    gru = FusedGRU(INPUT, HIDDEN, bidirectional=True)
    with pytest.raises(ValueError, match="input must be 3-D .* got 4-D"):
        gru(torch.randn(1, SEQ, BATCH, INPUT))
    with pytest.raises(ValueError, match="hx must be 3-D .* got 2-D"):
        gru(torch.randn(SEQ, BATCH, INPUT), torch.randn(2, HIDDEN))
    with pytest.raises(ValueError, match="hx must be 2-D .* got 3-D"):
        gru(torch.randn(SEQ, INPUT), torch.randn(2, 1, HIDDEN))
    packed = nn.utils.rnn.pack_sequence([torch.randn(3, INPUT), torch.randn(2, INPUT)])
    with pytest.raises(TypeError, match="PackedSequence.*pad_packed_sequence"):
        gru(packed)
    # The op checks the sizes, naming the argument.
    with pytest.raises(RuntimeError, match="input has input_size 5"):
        gru(torch.randn(SEQ, BATCH, INPUT + 1))
    with pytest.raises(RuntimeError, match="hx must be"):
        gru(torch.randn(SEQ, BATCH, INPUT), torch.randn(2, BATCH + 1, HIDDEN))


# ddpx.ops: the functions with keyword arguments and the defaults of the
# functions they mirror.
def test_ops_tiled_conv2d_takes_f_conv2d_arguments():
    torch.manual_seed(3)
    x, w, b = torch.randn(2, 4, 9, 8), torch.randn(6, 2, 3, 3), torch.randn(6)
    for kw in ({}, {"stride": 2}, {"padding": (1, 2), "dilation": 2}, {"groups": 2},
               {"stride": [2, 1], "padding": 1, "groups": 2}):
        wt = w if kw.get("groups", 1) == 2 else torch.randn(6, 4, 3, 3)
        assert_close(ddpx.ops.tiled_conv2d(x, wt, b, **kw),
                     torch.nn.functional.conv2d(x, wt, b, **kw), rtol=1e-4, atol=1e-5)
    w1 = torch.randn(6, 4, 1, 1)  # unbatched input, as F.conv2d takes it
    assert_close(ddpx.ops.tiled_conv2d(x[0], w1), torch.nn.functional.conv2d(x[0], w1),
                 rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="padding"):
        ddpx.ops.tiled_conv2d(x, w, padding="same")
    with pytest.raises(ValueError, match="stride"):
        ddpx.ops.tiled_conv2d(x, w, stride=(1, 2, 3))


def test_ops_fused_gru_takes_vf_gru_arguments():
    torch.manual_seed(4)
    ref = nn.GRU(5, 7, num_layers=2, bidirectional=True)
    x = torch.randn(6, 3, 5)
    want = ref(x)
    got = ddpx.ops.fused_gru(x, None, ref._flat_weights, num_layers=2, bidirectional=True)
    for a, b in zip(got, want):
        assert_close(a, b, rtol=1e-5, atol=1e-5)
