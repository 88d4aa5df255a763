"""ddpx::tiled_conv2d on CPU against torch.nn.functional.conv2d (ATen).

Tolerances (inputs ~ N(0, 1)):
  float64: rtol 1e-9, atol 1e-9 * max(1, max|ref|)  (only summation order differs)
  float32: rtol 1e-4, atol 1e-4 * max(1, max|ref|)  (grad_weight sums up to ~10^4
           products; ATen and we add them in different orders)
"""
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

op = torch.ops.ddpx.tiled_conv2d
TOL = {torch.float64: 1e-9, torch.float32: 1e-4}


def assert_close(got, ref, dtype, what):
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    tol = TOL[dtype]
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


# ---- generated configurations ------------------------------------------------------------


def _configs(count=240, seed=3):
    rng = random.Random(seed)
    out = []
    sizes = [1, 17, 97, 2, 5, 8, 13]
    layouts = ["contiguous", "channels_last", "noncontiguous"]
    while len(out) < count:
        i = len(out)
        kh, kw = rng.randint(1, 7), rng.randint(1, 7)
        sh, sw = rng.randint(1, 3), rng.randint(1, 3)
        ph, pw = rng.randint(0, 3), rng.randint(0, 3)
        dh, dw = rng.randint(1, 3), rng.randint(1, 3)
        # Every odd size appears often; 97 only with a few channels (test time).
        h = sizes[i % len(sizes)]
        w = sizes[(i * 5 + 3) % len(sizes)]
        if dh * (kh - 1) + 1 > h + 2 * ph or dw * (kw - 1) + 1 > w + 2 * pw:
            continue  # empty output: covered by the error tests
        kind = ["plain", "grouped", "depthwise", "single"][i % 4]
        if kind == "single":
            cin, groups, cout = 1, 1, rng.choice([1, 2])
        elif kind == "depthwise":
            cin = rng.choice([1, 3, 4])
            groups, cout = cin, cin * rng.choice([1, 2])
        elif kind == "grouped":
            groups = rng.choice([2, 3])
            cin, cout = groups * rng.choice([1, 2, 3]), groups * rng.choice([1, 2])
        else:  # enough channels to take the implicit-GEMM path
            cin, groups, cout = rng.choice([2, 5, 6]), 1, rng.choice([1, 3, 4])
        if max(h, w) == 97 and cin * cout > 12:
            cin, groups, cout = 1, 1, 2
        batch = [0, 1, 2][i % 3] if i % 7 else None  # None: unbatched 3-D input
        out.append(dict(kh=kh, kw=kw, stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw),
                        h=h, w=w, cin=cin, cout=cout, groups=groups, batch=batch,
                        layout=layouts[i % 3], bias=bool(i % 2)))
    return out


CONFIGS = _configs()


def _cfg_id(c):
    b = "U" if c["batch"] is None else c["batch"]
    return (f"b{b}_c{c['cin']}-{c['cout']}g{c['groups']}_{c['h']}x{c['w']}_k{c['kh']}x{c['kw']}"
            f"_s{c['stride'][0]}{c['stride'][1]}_p{c['padding'][0]}{c['padding'][1]}"
            f"_d{c['dilation'][0]}{c['dilation'][1]}_{c['layout']}{'_bias' if c['bias'] else ''}")


def _make_input(c, dtype, gen):
    shape = (c["cin"], c["h"], c["w"]) if c["batch"] is None else (c["batch"], c["cin"], c["h"],
                                                                 c["w"])
    if c["layout"] == "noncontiguous":
        # Every other element of the last dimension of a wider tensor.
        big = torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype, generator=gen)
        x = big[..., ::2]
        assert not x.is_contiguous() or x.numel() <= 1
    else:
        x = torch.randn(*shape, dtype=dtype, generator=gen)
        if c["layout"] == "channels_last" and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_()


def test_config_coverage():
    """The generated suite covers what the issue lists."""
    assert len(CONFIGS) >= 200
    assert {c["kh"] for c in CONFIGS} == set(range(1, 8))
    assert {c["stride"][0] for c in CONFIGS} == {1, 2, 3}
    assert {c["padding"][0] for c in CONFIGS} == {0, 1, 2, 3}
    assert {c["dilation"][0] for c in CONFIGS} == {1, 2, 3}
    assert {1, 17, 97} <= {c["h"] for c in CONFIGS}
    assert {0, 1, None} <= {c["batch"] for c in CONFIGS}
    assert any(c["groups"] == c["cin"] > 1 for c in CONFIGS)  # depthwise
    assert any(c["cin"] // c["groups"] > 4 for c in CONFIGS)  # the GEMM path
    assert {"contiguous", "channels_last", "noncontiguous"} == {c["layout"] for c in CONFIGS}
    assert {True, False} == {c["bias"] for c in CONFIGS}


# `auto` is what users get (mostly ATen's convolution in float32, see
# kernels/cpu/tiled_conv2d_path.h); `tiled` keeps every configuration on our own
# direct / implicit-GEMM kernels, which this suite was written for.
@pytest.mark.parametrize("path", ["auto", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("c", CONFIGS, ids=[_cfg_id(c) for c in CONFIGS])
def test_matches_aten(c, dtype, path, monkeypatch):
    monkeypatch.setenv("DDPX_CONV_PATH", path)
    gen = torch.Generator().manual_seed(hash(_cfg_id(c)) % (2**31))
    x = _make_input(c, dtype, gen)
    w = torch.randn(c["cout"], c["cin"] // c["groups"], c["kh"], c["kw"], dtype=dtype,
                    generator=gen).requires_grad_()
    b = torch.randn(c["cout"], dtype=dtype, generator=gen).requires_grad_() if c["bias"] else None
    args = (c["stride"], c["padding"], c["dilation"], c["groups"])
    before = [t.detach().clone() for t in (x, w, b) if t is not None]
    y = op(x, w, b, *args)
    for t, t0 in zip([t for t in (x, w, b) if t is not None], before):
        assert torch.equal(t.detach(), t0), "the op modified one of its inputs"
    r = F.conv2d(x, w, b, *args)
    assert_close(y, r, dtype, "output")
    if r.numel() > 1 and min(r.shape) > 1:
        # Same memory format as ATen gives (strides are ambiguous on size-1 dims).
        assert y.stride() == r.stride(), f"strides {y.stride()} != ATen's {r.stride()}"
    go = torch.randn(r.shape, dtype=dtype, generator=gen)
    inputs = [x, w] + ([b] if b is not None else [])
    got = torch.autograd.grad(y, inputs, go)
    ref = torch.autograd.grad(r, inputs, go)
    for name, g, gr in zip(["grad_input", "grad_weight", "grad_bias"], got, ref):
        assert_close(g, gr, dtype, name)


# ---- larger planes: vector interior, many row blocks, partial-sum reduction -------------


@pytest.mark.parametrize("k", [3, 5])
def test_single_channel_large_image(k):
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(1, 1, 300, 301, generator=gen, requires_grad=True)
    w = torch.randn(1, 1, k, k, generator=gen, requires_grad=True)
    b = torch.randn(1, generator=gen, requires_grad=True)
    y = op(x, w, b, [1, 1], [k // 2, k // 2], [1, 1], 1)
    r = F.conv2d(x, w, b, 1, k // 2)
    assert_close(y, r, torch.float32, "output")
    go = torch.randn(r.shape, generator=gen)
    for name, g, gr in zip(["grad_input", "grad_weight", "grad_bias"],
                           torch.autograd.grad(y, (x, w, b), go),
                           torch.autograd.grad(r, (x, w, b), go)):
        assert_close(g, gr, torch.float32, name)


def test_gemm_path_batch_parallel_and_tiled():
    # 40 channels x 3x3 make several GEMM row tiles per image; batch 4 > threads.
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 40, 33, 35, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(24, 20, 3, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    y = op(x, w, None, [1, 2], [1, 0], [2, 1], 2)
    r = F.conv2d(x, w, None, (1, 2), (1, 0), (2, 1), 2)
    assert_close(y, r, torch.float64, "output")
    go = torch.randn(r.shape, dtype=torch.float64, generator=gen)
    for name, g, gr in zip(["grad_input", "grad_weight"], torch.autograd.grad(y, (x, w), go),
                           torch.autograd.grad(r, (x, w), go)):
        assert_close(g, gr, torch.float64, name)


def test_scalar_build_matches():
    """The DEFAULT (no AVX) build of the inner loops gives the same results."""
    code = (
        "import os, torch, torch.nn.functional as F\n"
        "torch.ops.load_library(os.environ['DDPX_LIB'])\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for k, s, p, d in [(3, 1, 1, 1), (5, 2, 2, 1), (4, 1, 3, 2)]:\n"
        "    x = torch.randn(2, 2, 61, 70, generator=g, requires_grad=True)\n"
        "    w = torch.randn(2, 1, k, k, generator=g, requires_grad=True)\n"
        "    y = torch.ops.ddpx.tiled_conv2d(x, w, None, [s, s], [p, p], [d, d], 2)\n"
        "    r = F.conv2d(x, w, None, s, p, d, 2)\n"
        "    torch.testing.assert_close(y, r, rtol=1e-4, atol=1e-4)\n"
        "    go = torch.randn(r.shape, generator=g)\n"
        "    for a, b in zip(torch.autograd.grad(y, (x, w), go), torch.autograd.grad(r, (x, w), go)):\n"
        "        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)\n"
    )
    env = dict(os.environ, DDPX_CPU_CAPABILITY="default")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]


# ---- degenerate problems -------------------------------------------------------------------
# No input channels, or an empty plane under padding: ATen's convolution does
# not compute these (zero output channels and a zero grad_bias; an error), so
# every path choice keeps them on our kernels (tiled_conv2d_args.h,
# aten_computes) and the answer is the convolution's by definition, whichever
# path was asked for.

DEGENERATE = [  # (input, weight, padding, groups)
    ((2, 0, 5, 5), (3, 0, 3, 3), (0, 0), 1),
    ((2, 0, 6, 7), (4, 0, 5, 5), (2, 2), 2),
    ((0, 4, 4), (2, 0, 3, 3), (1, 1), 1),  # unbatched
    ((2, 3, 0, 5), (4, 3, 1, 1), (1, 1), 1),
    ((1, 2, 4, 0), (2, 1, 3, 3), (2, 2), 2),
    ((2, 1, 0, 0), (3, 1, 5, 5), (3, 4), 1),
]


def degenerate_case(case, device, dtype):
    """Output and gradients of one DEGENERATE case against their definition:
    zero-padding then a convolution without padding (F.conv2d computes that,
    the padded plane being non-empty); with no input channels, the bias."""
    xs, ws, pad, groups = case
    gen = torch.Generator().manual_seed(5)
    make = lambda *shape: (torch.randn(shape, dtype=torch.float64, generator=gen)  # noqa: E731
                           .to(device, dtype).requires_grad_())
    x, w, b = make(*xs), make(*ws), make(ws[0])
    y = op(x, w, b, [1, 1], list(pad), [1, 1], groups)
    if xs[-3] == 0:
        oh, ow = (xs[-2] + 2 * pad[0] - ws[2] + 1, xs[-1] + 2 * pad[1] - ws[3] + 1)
        r = b.view(-1, 1, 1).expand(ws[0], oh, ow)
        r = r if len(xs) == 3 else r.expand(xs[0], -1, -1, -1)
    else:
        r = F.conv2d(F.pad(x, (pad[1], pad[1], pad[0], pad[0])), w, b, groups=groups)
    tol_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # (TOL's keys)
    assert_close(y, r, tol_dtype, "output")
    go = torch.randn(r.shape, dtype=torch.float64, generator=gen).to(device, dtype)
    got = torch.autograd.grad(y, (x, w, b), go)
    ref = torch.autograd.grad(r, (x, w, b), go, allow_unused=True, materialize_grads=True)
    for name, g, gr in zip(["grad_input", "grad_weight", "grad_bias"], got, ref):
        assert_close(g, gr, tol_dtype, name)
    path = torch.ops.ddpx.tiled_conv2d_path(x, w, [1, 1], list(pad), [1, 1], groups)
    assert "aten" not in path and "measure" not in path, path


@pytest.mark.parametrize("path", ["auto", "benchmark", "tiled", "direct", "gemm", "aten"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", DEGENERATE, ids=[str(c[:2]) for c in DEGENERATE])
def test_degenerate_problem_on_every_path(case, dtype, path, monkeypatch):
    monkeypatch.setenv("DDPX_CONV_PATH", path)
    degenerate_case(case, "cpu", dtype)


# ---- autograd checks ----------------------------------------------------------------------


GRADCHECK = [
    dict(shape=(2, 2, 7, 6), w=(3, 2, 3, 2), s=(1, 1), p=(1, 0), d=(1, 1), g=1, bias=True),
    dict(shape=(1, 4, 8, 9), w=(4, 1, 3, 3), s=(2, 1), p=(1, 2), d=(2, 1), g=4, bias=False),
    dict(shape=(2, 6, 6, 7), w=(4, 3, 2, 3), s=(1, 2), p=(0, 1), d=(1, 2), g=2, bias=True),
    dict(shape=(3, 5, 5), w=(2, 3, 1, 2), s=(3, 1), p=(2, 0), d=(1, 1), g=1, bias=True),
    dict(shape=(1, 8, 5, 5), w=(2, 8, 3, 3), s=(1, 1), p=(1, 1), d=(1, 1), g=1, bias=True),
]


def gradcheck_case(cfg, device):
    """gradcheck in double of one GRADCHECK case (also run on CUDA)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(cfg["shape"], dtype=torch.float64, generator=gen).to(device).requires_grad_()
    w = torch.randn(cfg["w"], dtype=torch.float64, generator=gen).to(device).requires_grad_()
    b = (torch.randn(cfg["w"][0], dtype=torch.float64, generator=gen).to(device).requires_grad_()
         if cfg["bias"] else None)
    fn = lambda x, w, b: op(x, w, b, cfg["s"], cfg["p"], cfg["d"], cfg["g"])  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b))


@pytest.mark.parametrize("cfg", GRADCHECK)
def test_gradcheck(cfg):
    gradcheck_case(cfg, "cpu")


def test_only_requested_gradients():
    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    w = torch.randn(3, 2, 3, 3)  # no grad
    b = torch.randn(3, requires_grad=True)
    y = op(x, w, b)
    y.sum().backward()
    assert w.grad is None and x.grad is not None and b.grad is not None
    torch.testing.assert_close(b.grad, torch.full((3,), 9.0))


def test_backward_op_output_mask():
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    go = torch.randn(1, 3, 3, 3)
    gi, gw, gb = torch.ops.ddpx._tiled_conv2d_backward(go, x, w, [1, 1], [0, 0], [1, 1], 1,
                                                       [False, True, False])
    assert gi is None and gb is None
    ref = torch.ops.aten.convolution_backward(go, x, w, None, [1, 1], [0, 0], [1, 1], False,
                                              [0, 0], 1, [False, True, False])[1]
    torch.testing.assert_close(gw, ref)


def test_double_backward_fails_clearly():
    x = torch.randn(1, 1, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 1, 3, 3, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(op(x, w).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward of ddpx::tiled_conv2d"):
        gx.sum().backward()


# ---- opcheck, TorchScript, torch.compile -------------------------------------------------

OPCHECK = [
    ((2, 3, 9, 8), (4, 3, 3, 3), True, [1, 1], [1, 1], [1, 1], 1),
    ((1, 4, 7, 7), (4, 1, 3, 3), False, [2, 2], [1, 1], [1, 1], 4),
    ((2, 6, 10, 9), (4, 3, 2, 3), True, [1, 2], [0, 2], [2, 1], 2),
    ((3, 11, 12), (2, 3, 5, 5), True, [1, 1], [2, 2], [1, 1], 1),
    ((2, 6, 8, 8), (6, 6, 1, 1), False, [1, 1], [0, 0], [1, 1], 1),
]


def opcheck_case(case, device, dtype=torch.float32):
    """torch.library.opcheck of one OPCHECK case (also run on CUDA)."""
    xs, ws, has_b, s, p, d, g = case
    x = torch.randn(xs, device=device, dtype=dtype, requires_grad=True)
    if x.dim() == 4 and case is OPCHECK[0]:
        x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(ws, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(ws[0], device=device, dtype=dtype, requires_grad=True) if has_b else None
    torch.library.opcheck(op, (x, w, b, s, p, d, g))


@pytest.mark.parametrize("case", OPCHECK, ids=[str(i) for i in range(len(OPCHECK))])
def test_opcheck(case):
    opcheck_case(case, "cpu")


def test_opcheck_backward_op():
    go, x, w = torch.randn(2, 4, 9, 8), torch.randn(2, 3, 9, 8), torch.randn(4, 3, 3, 3)
    torch.library.opcheck(torch.ops.ddpx._tiled_conv2d_backward,
                          (go, x, w, [1, 1], [1, 1], [1, 1], 1, [True, True, True]))


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(6, 1, 5, 5))
        self.b1 = torch.nn.Parameter(torch.randn(6))
        self.w2 = torch.nn.Parameter(torch.randn(16, 6, 5, 5))

    def forward(self, x):
        x = torch.relu(torch.ops.ddpx.tiled_conv2d(x, self.w1, self.b1, [1, 1], [2, 2]))
        return torch.ops.ddpx.tiled_conv2d(x, self.w2, None, [2, 2], [0, 0], [1, 1], 1)


def test_torchscript():
    net = _Net()
    scripted = torch.jit.script(net)
    x = torch.randn(3, 1, 28, 28)
    torch.testing.assert_close(scripted(x), net(x))
    scripted(x).sum().backward()
    assert scripted.w1.grad is not None


def test_torch_compile_fullgraph():
    torch._dynamo.reset()

    def f(x, w, b):
        return torch.ops.ddpx.tiled_conv2d(x, w, b, [1, 2], [1, 1], [1, 1], 2).relu().sum()

    x = torch.randn(2, 4, 11, 10, requires_grad=True)
    w = torch.randn(6, 2, 3, 3, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(x, w, b)
    got_grads = torch.autograd.grad(got, (x, w, b))
    ref = f(x, w, b)
    torch.testing.assert_close(got, ref)
    for a, r in zip(got_grads, torch.autograd.grad(ref, (x, w, b))):
        torch.testing.assert_close(a, r)


# ---- bad input: each error names its argument ------------------------------------------


def _bad_cases():
    x, w = torch.randn(1, 4, 8, 8), torch.randn(2, 4, 3, 3)
    return [
        ("input must be 3-D", lambda: op(torch.randn(4, 8), w)),
        ("input must be 3-D", lambda: op(torch.randn(1, 1, 4, 8, 8), w)),
        ("weight must be 4-D", lambda: op(x, torch.randn(2, 4, 3))),
        (r"input channels \(4\) must be divisible by groups \(3\)",
         lambda: op(x, torch.randn(3, 1, 3, 3), None, 1, 0, 1, 3)),
        (r"weight.size\(0\) \(out_channels = 3\) must be divisible by groups",
         lambda: op(x, torch.randn(3, 2, 3, 3), None, 1, 0, 1, 2)),
        (r"weight.size\(1\) \* groups", lambda: op(x, torch.randn(2, 3, 3, 3))),
        ("padding must be non-negative", lambda: op(x, w, None, 1, [-1, 0])),
        ("stride must be positive", lambda: op(x, w, None, [0, 1])),
        ("dilation must be positive", lambda: op(x, w, None, 1, 0, [1, 0])),
        ("weight must have the same dtype as input", lambda: op(x, w.double())),
        ("bias must have the same dtype as input", lambda: op(x, w, torch.randn(2).double())),
        ("bias must have out_channels", lambda: op(x, w, torch.randn(3))),
        ("bias must be 1-D", lambda: op(x, w, torch.randn(2, 1))),
        ("weight must be on the same device as input", lambda: op(x, w.to("meta"))),
        ("bias must be on the same device as input", lambda: op(x, w, torch.randn(2, device="meta"))),
        ("output size would be empty", lambda: op(torch.randn(1, 4, 2, 2), w)),
        ("output size would be empty", lambda: op(x, w, None, 1, 0, [4, 1])),
        ("input dtype .* is not supported", lambda: op(x.half(), w.half())),
        ("input dtype .* is not supported", lambda: op(x.long(), w.long())),
        ("stride must have 2 elements", lambda: op(x, w, None, [1, 1, 1])),
        ("groups must be positive", lambda: op(x, w, None, 1, 0, 1, 0)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_names_argument(case):
    msg, call = _bad_cases()[case]
    with pytest.raises(RuntimeError, match=msg):
        call()


def test_bad_input_on_meta_and_backward():
    # The Meta kernel (torch.compile) and the backward op check at their doors too.
    with pytest.raises(RuntimeError, match="input channels"):
        op(torch.randn(1, 4, 8, 8, device="meta"), torch.randn(3, 1, 3, 3, device="meta"), None,
           1, 0, 1, 3)
    with pytest.raises(RuntimeError, match="grad_output must have the forward output's shape"):
        torch.ops.ddpx._tiled_conv2d_backward(torch.randn(1, 2, 5, 5), torch.randn(1, 4, 8, 8),
                                              torch.randn(2, 4, 3, 3), [1, 1], [0, 0], [1, 1], 1,
                                              [True, True, True])


def test_cpp_entry_is_differentiable_from_script():
    # The C++ entry calls through the dispatcher; the TorchScript path goes through
    # the same registered Autograd kernel.
    @torch.jit.script
    def f(x, w):
        return torch.ops.ddpx.tiled_conv2d(x, w)

    x = torch.randn(1, 1, 6, 6, requires_grad=True)
    w = torch.randn(1, 1, 3, 3, requires_grad=True)
    f(x, w).sum().backward()
    torch.testing.assert_close(w.grad, F.unfold(x.detach(), 3).sum(-1).view(1, 1, 3, 3))
