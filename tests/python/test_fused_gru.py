"""ddpx::fused_gru against torch.nn.GRU with the same weights (CPU).

Tolerances: float64 compares to nn.GRU at rtol 1e-9 / atol 1e-10 (the two
differ only in summation order); float32 at rtol 1e-4 / atol 2e-5 (weight
gradients sum seq*batch products).
"""
import random
import zlib
from typing import List, Optional, Tuple

import pytest
import torch
from torch.testing import assert_close

OP = torch.ops.ddpx.fused_gru
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=2e-5)}


def make_gru(input_size, hidden, layers, bias=True, bidirectional=False, batch_first=False,
             dtype=torch.float64, dropout=0.0):
    return torch.nn.GRU(input_size, hidden, layers, bias=bias, bidirectional=bidirectional,
                        batch_first=batch_first, dtype=dtype, dropout=dropout)


def copy_params(gru):
    return [p.detach().clone().requires_grad_() for p in gru._flat_weights]


def run_ours(gru, x, hx, params):
    return OP(x, hx, params, gru.bias, gru.num_layers, float(gru.dropout), gru.training,
              gru.bidirectional, gru.batch_first)


def non_contiguous(t):
    """Same values as t, but every dimension strided (a slice of a wider tensor)."""
    wide = torch.zeros(*[2 * s for s in t.shape], dtype=t.dtype)
    view = wide[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    assert not view.is_contiguous() or t.numel() <= 1
    return view


def _configs(n_random=110):
    """Configurations of the issue's space, corners first, then seeded random ones."""
    rng = random.Random(4)
    cfgs = [
        # layers, bidirectional, batch_first, bias, seq, batch, input, hidden, hx, noncontig, unbatched
        (1, False, False, True, 1, 1, 1, 1, False, False, False),
        (3, True, True, False, 50, 17, 5, 7, True, True, False),
        (2, True, False, True, 3, 2, 4, 97, True, False, False),
        (1, False, True, True, 50, 1, 3, 97, False, True, False),
        (3, False, False, True, 1, 17, 2, 1, True, False, False),
        (2, True, True, True, 7, 1, 3, 5, True, True, True),
        (1, False, False, False, 9, 1, 6, 4, False, False, True),
    ]
    for _ in range(n_random):
        layers = rng.randint(1, 3)
        bidirectional = rng.random() < 0.5
        # Keep the total work small: long sequences with small hidden sizes.
        seq = rng.choice([1, 2, 5, 13, 31, 50])
        hidden = rng.choice([1, 2, 3, 8, 16, 17, 33]) if seq > 13 else rng.randint(1, 97)
        cfgs.append((layers, bidirectional, rng.random() < 0.5, rng.random() < 0.8, seq,
                     rng.randint(1, 17), rng.randint(1, 12), hidden, rng.random() < 0.5,
                     rng.random() < 0.3, rng.random() < 0.1))
    dtypes = [torch.float64 if i % 4 else torch.float32 for i in range(len(cfgs))]
    return [c + (d,) for c, d in zip(cfgs, dtypes)]


CONFIGS = _configs()


def _cfg_id(c):
    L, bi, bf, bias, T, B, I, H, hx, nc, ub, dt = c
    return (f"L{L}{'bi' if bi else ''}{'_bf' if bf else ''}{'' if bias else '_nobias'}"
            f"_T{T}_B{'u' if ub else B}_I{I}_H{H}{'_hx' if hx else ''}{'_nc' if nc else ''}"
            f"_{str(dt)[6:]}")


def test_enough_configurations():
    assert len(CONFIGS) >= 100


@pytest.mark.parametrize("cfg", CONFIGS, ids=[_cfg_id(c) for c in CONFIGS])
def test_matches_nn_gru(cfg):
    compare_with_nn_gru(cfg)


# Batches large enough that the CPU gate step is split across the batch rows
# (tasks of 4096 // hidden rows): hidden 33 gives 124 rows per task, so batch
# 257 makes 3 tasks, the last one 9 rows; hidden 300 gives 13 rows per task.
PARALLEL = [
    (1, False, False, True, 3, 257, 5, 33, True, False, False, torch.float64),
    (2, True, True, False, 2, 257, 4, 33, False, True, False, torch.float64),
    (1, True, False, True, 2, 40, 3, 300, True, True, False, torch.float32),
    (2, False, True, True, 2, 27, 6, 300, False, False, False, torch.float64),
]


@pytest.mark.parametrize("cfg", PARALLEL, ids=[_cfg_id(c) for c in PARALLEL])
def test_batch_parallel_gate_step_matches_nn_gru(cfg):
    B, H = cfg[5], cfg[7]
    per = 4096 // H
    path = torch.ops.ddpx.fused_gru_path(torch.empty(2, B, 3), H)
    assert path == f"batch-parallel:{-(-B // per)}"
    compare_with_nn_gru(cfg)


def test_gate_step_path_is_serial_for_small_steps():
    assert torch.ops.ddpx.fused_gru_path(torch.empty(5, 16, 3), 64) == "serial"
    assert torch.ops.ddpx.fused_gru_path(torch.empty(5, 3), 4096) == "serial"  # unbatched
    assert torch.ops.ddpx.fused_gru_path(torch.empty(64, 5, 3), 256, True) == "batch-parallel:4"
    with pytest.raises(RuntimeError, match="hidden_size must be positive"):
        torch.ops.ddpx.fused_gru_path(torch.empty(5, 2, 3), 0)


def compare_with_nn_gru(cfg):
    L, bi, bf, bias, T, B, I, H, with_hx, noncontig, unbatched, dtype = cfg
    torch.manual_seed(zlib.crc32(_cfg_id(cfg).encode()))
    gru = make_gru(I, H, L, bias, bi, bf, dtype)
    D = 2 if bi else 1
    if unbatched:
        x_shape, hx_shape = (T, I), (L * D, H)
    else:
        x_shape, hx_shape = ((B, T, I) if bf else (T, B, I)), (L * D, B, H)
    x = torch.randn(x_shape, dtype=dtype)
    hx = torch.randn(hx_shape, dtype=dtype) if with_hx else None
    if noncontig:
        x = non_contiguous(x)
        hx = non_contiguous(hx) if hx is not None else None
    x.requires_grad_()
    if hx is not None:
        hx.requires_grad_()
    params = copy_params(gru)

    y_ref, h_ref = gru(x, hx)
    y, h = run_ours(gru, x, hx, params)
    assert y.shape == y_ref.shape and h.shape == h_ref.shape
    tol = TOL[dtype]
    assert_close(y, y_ref, **tol)
    assert_close(h, h_ref, **tol)

    gy, gh = torch.randn_like(y_ref), torch.randn_like(h_ref)
    wrt_ref = [x] + ([hx] if hx is not None else []) + list(gru._flat_weights)
    wrt = [x] + ([hx] if hx is not None else []) + params
    names = ["input"] + (["hx"] if hx is not None else []) + list(gru._flat_weights_names)
    g_ref = torch.autograd.grad((y_ref * gy).sum() + (h_ref * gh).sum(), wrt_ref)
    g = torch.autograd.grad((y * gy).sum() + (h * gh).sum(), wrt)
    for name, a, b in zip(names, g, g_ref):
        assert_close(a, b, **tol, msg=lambda m: f"grad of {name}: {m}")


def test_only_h_n_used_and_only_output_used():
    gru = make_gru(3, 5, 2, bidirectional=True)
    x = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    params = copy_params(gru)
    for pick in (0, 1):
        ref = gru(x)[pick].sum()
        got = run_ours(gru, x, None, params)[pick].sum()
        g_ref = torch.autograd.grad(ref, [x, *gru._flat_weights])
        g = torch.autograd.grad(got, [x, *params])
        for a, b in zip(g, g_ref):
            assert_close(a, b, **TOL[torch.float64])


def test_empty_batch_like_nn_gru():
    gru = make_gru(3, 4, 2, bidirectional=True)
    x = torch.randn(5, 0, 3, dtype=torch.float64, requires_grad=True)
    y_ref, h_ref = gru(x)
    y, h = run_ours(gru, x, None, copy_params(gru))
    assert y.shape == y_ref.shape and h.shape == h_ref.shape
    y.sum().backward()
    assert x.grad.shape == x.shape


GRADCHECK = [
    (2, True, False, True, False),
    (1, False, True, False, False),
    (2, False, False, True, True),
]


@pytest.mark.parametrize("layers,bidirectional,batch_first,bias,unbatched", GRADCHECK)
def test_gradcheck(layers, bidirectional, batch_first, bias, unbatched):
    gradcheck_case(layers, bidirectional, batch_first, bias, unbatched, "cpu")


def gradcheck_case(layers, bidirectional, batch_first, bias, unbatched, device):
    """gradcheck in double of one case (also run on CUDA)."""
    torch.manual_seed(0)
    gru = make_gru(3, 2, layers, bias, bidirectional, batch_first)
    D = 2 if bidirectional else 1
    if unbatched:
        x, hx = torch.randn(3, 3), torch.randn(layers * D, 2)
    else:
        x = torch.randn((2, 3, 3) if batch_first else (3, 2, 3))
        hx = torch.randn(layers * D, 2, 2)
    x, hx = x.double().to(device).requires_grad_(), hx.double().to(device).requires_grad_()
    params = [p.detach().to(device).requires_grad_() for p in copy_params(gru)]

    def f(x, hx, *params):
        return OP(x, hx, list(params), bias, layers, 0.0, False, bidirectional, batch_first)

    assert torch.autograd.gradcheck(f, (x, hx, *params))


def test_double_backward_is_an_explicit_error():
    gru = make_gru(3, 4, 1)
    x = torch.randn(2, 1, 3, dtype=torch.float64, requires_grad=True)
    y, _ = run_ours(gru, x, None, copy_params(gru))
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward of ddpx::fused_gru is not supported"):
        gx.sum().backward()


def _opcheck_args(requires_grad, layers=2, bidirectional=True, hx=True, dropout=0.0, train=False):
    torch.manual_seed(0)
    gru = make_gru(3, 4, layers, bidirectional=bidirectional)
    D = 2 if bidirectional else 1
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=requires_grad)
    h = torch.randn(layers * D, 2, 4, dtype=torch.float64, requires_grad=requires_grad) if hx \
        else None
    params = [p.detach().clone().requires_grad_(requires_grad) for p in gru._flat_weights]
    return (x, h, params, True, layers, dropout, train, bidirectional, False)


@pytest.mark.parametrize("requires_grad", [True, False])
@pytest.mark.parametrize("hx", [True, False])
def test_opcheck_fused_gru(requires_grad, hx):
    torch.library.opcheck(torch.ops.ddpx.fused_gru.default, _opcheck_args(requires_grad, hx=hx))


def test_opcheck_forward_and_backward_ops():
    args = _opcheck_args(False)
    torch.library.opcheck(torch.ops.ddpx._fused_gru_forward.default, args)
    output, h_n, gates, layer_outputs, masks = torch.ops.ddpx._fused_gru_forward(*args)
    x, hx, params, bias, layers, _, _, bidirectional, batch_first = args
    bwd_args = (torch.randn_like(output), torch.randn_like(h_n), x, hx, params, output, gates,
                layer_outputs, masks, bias, layers, bidirectional, batch_first)
    torch.library.opcheck(torch.ops.ddpx._fused_gru_backward.default, bwd_args)


def test_torch_jit_script():
    @torch.jit.script
    def run(x: torch.Tensor, hx: Optional[torch.Tensor],
            params: List[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.ddpx.fused_gru(x, hx, params, True, 2, 0.0, False, True, True)

    gru = make_gru(3, 4, 2, bidirectional=True, batch_first=True)
    x = torch.randn(2, 6, 3, dtype=torch.float64, requires_grad=True)
    params = copy_params(gru)
    y, h = run(x, None, params)
    y_ref, h_ref = gru(x)
    assert_close(y, y_ref, **TOL[torch.float64])
    assert_close(h, h_ref, **TOL[torch.float64])
    (gx,) = torch.autograd.grad(y.sum(), x)
    (gx_ref,) = torch.autograd.grad(y_ref.sum(), x)
    assert_close(gx, gx_ref, **TOL[torch.float64])


def test_torch_compile_forward_and_backward():
    gru = make_gru(3, 4, 2, bidirectional=True, dtype=torch.float32)
    params = copy_params(gru)

    def step(x, params):
        y, h = OP(x, None, params, True, 2, 0.0, True, True, False)
        return (y * y).sum() + h.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    x = torch.randn(5, 3, 3, requires_grad=True)
    loss = compiled(x, params)
    grads = torch.autograd.grad(loss, [x, *params])
    y_ref, h_ref = gru(x)
    loss_ref = (y_ref * y_ref).sum() + h_ref.sum()
    grads_ref = torch.autograd.grad(loss_ref, [x, *gru._flat_weights])
    assert_close(loss, loss_ref, **TOL[torch.float32])
    for a, b in zip(grads, grads_ref):
        assert_close(a, b, **TOL[torch.float32])


# ---- dropout between layers ----------------------------------------------------------


def _layerwise_reference(gru, x, hx, params, masks):
    """nn.GRU's multi-layer recurrence written out with one-layer nn.GRUs and the given
    masks ([layers-1, seq, batch, D*hidden]) applied to each inner layer's output."""
    L, D, H = gru.num_layers, 2 if gru.bidirectional else 1, gru.hidden_size
    per = len(params) // (L * D)
    layer_in, h_n = x, []
    for layer in range(L):
        cell_params = params[layer * D * per:(layer + 1) * D * per]
        out, h = torch._VF.gru(layer_in, hx[layer * D:(layer + 1) * D], cell_params, gru.bias,
                               1, 0.0, False, gru.bidirectional, False)
        h_n.append(h)
        layer_in = out * masks[layer] if layer < L - 1 else out
    return layer_in, torch.cat(h_n)


@pytest.mark.parametrize("p", [0.3, 1.0])
def test_dropout_masks_are_consistent_with_output_and_gradients(p):
    L, T, B, I, H = 3, 6, 4, 3, 5
    gru = make_gru(I, H, L, bidirectional=True, dropout=p)
    x = torch.randn(T, B, I, dtype=torch.float64, requires_grad=True)
    hx = torch.randn(2 * L, B, H, dtype=torch.float64, requires_grad=True)
    params = copy_params(gru)
    torch.manual_seed(123)
    y, h = OP(x, hx, params, True, L, p, True, True, False)
    torch.manual_seed(123)
    y2, h2, _, _, masks = torch.ops.ddpx._fused_gru_forward(x, hx, params, True, L, p, True,
                                                            True, False)
    assert_close(y, y2, rtol=0, atol=0)
    assert masks.shape == (L - 1, T, B, 2 * H)
    keep = 1 / (1 - p) if p < 1 else 0.0
    assert bool(((masks == 0) | (masks == keep)).all())

    ref_params = [q.detach().clone().requires_grad_() for q in params]
    y_ref, h_ref = _layerwise_reference(gru, x, hx, ref_params, masks.detach())
    assert_close(y, y_ref, **TOL[torch.float64])
    assert_close(h, h_ref, **TOL[torch.float64])
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    g = torch.autograd.grad((y * gy).sum() + (h * gh).sum(), [x, hx, *params])
    g_ref = torch.autograd.grad((y_ref * gy).sum() + (h_ref * gh).sum(), [x, hx, *ref_params])
    for a, b in zip(g, g_ref):
        assert_close(a, b, **TOL[torch.float64])


def test_dropout_rate_matches_probability():
    L, T, B, H, p = 3, 20, 8, 16, 0.3
    gru = make_gru(4, H, L, bidirectional=True, dtype=torch.float32)
    x = torch.randn(T, B, 4)
    masks = torch.ops.ddpx._fused_gru_forward(x, None, copy_params(gru), True, L, p, True, True,
                                              False)[4]
    dropped = (masks == 0).double().mean().item()
    # 10240 Bernoulli draws: standard deviation of the rate is ~0.0045.
    assert abs(dropped - p) < 0.03


def test_dropout_is_off_outside_training_and_for_one_layer():
    gru = make_gru(3, 4, 2, dropout=0.5).eval()
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    y, _ = OP(x, None, copy_params(gru), True, 2, 0.5, False, False, False)
    assert_close(y, gru(x)[0], **TOL[torch.float64])
    one = make_gru(3, 4, 1)
    y, _ = OP(x, None, copy_params(one), True, 1, 0.5, True, False, False)
    assert_close(y, one(x)[0], **TOL[torch.float64])


# ---- bad input names the argument ----------------------------------------------------


def _bad_call(change):
    gru = make_gru(3, 4, 2)
    args = dict(input=torch.randn(5, 2, 3, dtype=torch.float64), hx=None,
                params=copy_params(gru), has_biases=True, num_layers=2, dropout=0.0,
                train=False, bidirectional=False, batch_first=False)
    change(args)
    return lambda: OP(*args.values())


def _set(**kw):
    return lambda a: a.update(kw)


def _set_param(i, t):
    return lambda a: a["params"].__setitem__(i, t)


BAD = [
    ("params must hold 8 tensors", lambda a: a["params"].pop()),
    ("params must hold 4 tensors", _set(has_biases=False)),
    (r"params\[5\] \(w_hh of layer 1\) must be \[3\*hidden_size, hidden_size\]",
     _set_param(5, torch.randn(12, 5, dtype=torch.float64))),
    (r"params\[4\] \(w_ih of layer 1\) must be \[3\*hidden_size, num_directions\*hidden_size\]",
     _set_param(4, torch.randn(12, 8, dtype=torch.float64))),
    (r"params\[2\] \(b_ih of layer 0\) must be \[3\*hidden_size\]",
     _set_param(2, torch.randn(11, dtype=torch.float64))),
    (r"params\[3\] \(b_hh of layer 0\) must have input's dtype",
     _set_param(3, torch.randn(12))),
    ("input has input_size 5", _set(input=torch.randn(5, 2, 5, dtype=torch.float64))),
    (r"hx must be \[num_layers\*num_directions, batch, hidden_size\] = \[2, 2, 4\]",
     _set(hx=torch.randn(2, 2, 5, dtype=torch.float64))),
    ("hx must be 3-D", _set(hx=torch.randn(2, 4, dtype=torch.float64))),
    ("hx must be 2-D", _set(input=torch.randn(5, 3, dtype=torch.float64),
                            hx=torch.randn(2, 1, 4, dtype=torch.float64))),
    ("input must be 3-D", _set(input=torch.randn(1, 5, 2, 3, dtype=torch.float64))),
    ("input must have a sequence length > 0", _set(input=torch.randn(0, 2, 3, dtype=torch.float64))),
    ("float32 and float64 input, got Long", _set(input=torch.ones(5, 2, 3, dtype=torch.long))),
    ("supports float32 and float64", lambda a: (a.update(input=a["input"].half()),
                                                a.update(params=[p.half() for p in a["params"]]))),
    ("dropout must be a probability", _set(dropout=1.5)),
    ("num_layers must be >= 1", _set(num_layers=0)),
]


@pytest.mark.parametrize("message,change", BAD, ids=[m[:30] for m, _ in BAD])
def test_bad_input_names_the_argument(message, change):
    with pytest.raises(RuntimeError, match=message):
        _bad_call(change)()


def test_opcheck_with_dropout_in_training():
    torch.library.opcheck(torch.ops.ddpx.fused_gru.default,
                          _opcheck_args(True, layers=3, dropout=0.4, train=True))
