"""ddpx::tiled_conv2d on CUDA against torch.nn.functional.conv2d (cuDNN, TF32 off).

Skips (with a message) where no GPU exists, fails under DDPX_REQUIRE_GPU=1
(scripts/device/check.sh); registered with label `gpu`. The whole CPU
reference suite (CONFIGS: every argument, non-contiguous, channels-last, empty
and odd sizes) in float64 and float32, every third case in the halves;
gradcheck and opcheck on the CPU suite's cases.
Tolerances, relative to max(1, max|ref|): float64 1e-9, float32 1e-4,
float16 1e-2, bfloat16 5e-2 (both sides accumulate in float32 for the halves).
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import needs_cuda
from test_tiled_conv2d import (CONFIGS, DEGENERATE, GRADCHECK, OPCHECK, _cfg_id, _make_input,
                               degenerate_case, gradcheck_case, opcheck_case)

pytestmark = needs_cuda
op = torch.ops.ddpx.tiled_conv2d
TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@pytest.fixture(autouse=True)
def _exact_reference(request, monkeypatch):
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    # Our CUDA kernels on every shape (the path rule sends most shapes to
    # cuDNN, which would then be compared with itself); the tests of the rule
    # itself are marked auto_path.
    if "auto_path" not in request.keywords:
        monkeypatch.setenv("DDPX_CONV_PATH", "tiled")
    yield
    torch.backends.cudnn.allow_tf32 = tf32


def _close(got, ref, dtype, what):
    assert got.shape == ref.shape, what
    if ref.numel():
        tol = TOL[dtype]
        scale = max(1.0, ref.abs().max().item())
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * scale,
                                   msg=lambda m: f"{what}: {m}")


SUBSET = CONFIGS[::3]
CASES = ([(c, d) for d in (torch.float64, torch.float32) for c in CONFIGS]
         + [(c, d) for d in (torch.float16, torch.bfloat16) for c in SUBSET])


@pytest.mark.parametrize("c,dtype", CASES,
                         ids=[f"{str(d)[6:]}-{_cfg_id(c)}" for c, d in CASES])
def test_cuda_matches_cudnn(c, dtype):
    gen = torch.Generator().manual_seed(1)
    x = _make_input(c, torch.float64, gen).detach().to("cuda", dtype).requires_grad_()
    w = torch.randn(c["cout"], c["cin"] // c["groups"], c["kh"], c["kw"], generator=gen,
                    dtype=torch.float64).to("cuda", dtype).requires_grad_()
    b = (torch.randn(c["cout"], generator=gen, dtype=torch.float64).to("cuda", dtype)
         .requires_grad_() if c["bias"] else None)
    args = (c["stride"], c["padding"], c["dilation"], c["groups"])
    # The reference in float64 for the halves: cuDNN's half kernels round differently.
    ref_dtype = torch.float64 if dtype in (torch.float16, torch.bfloat16) else dtype
    xr = x.detach().to(ref_dtype).requires_grad_()
    wr = w.detach().to(ref_dtype).requires_grad_()
    br = b.detach().to(ref_dtype).requires_grad_() if b is not None else None
    y = op(x, w, b, *args)
    r = F.conv2d(xr, wr, br, *args)
    _close(y, r, dtype, "output")
    go = torch.randn(r.shape, generator=gen, dtype=torch.float64).to("cuda")
    ins, rins = [x, w] + ([b] if b is not None else []), [xr, wr] + ([br] if br is not None else [])
    got = torch.autograd.grad(y, ins, go.to(dtype))
    ref = torch.autograd.grad(r, rins, go.to(ref_dtype))
    for name, g, gr in zip(["grad_input", "grad_weight", "grad_bias"], got, ref):
        _close(g, gr, dtype, name)


@pytest.mark.sanitizer
@pytest.mark.parametrize("shape", [(1, 1, 512, 512, 1, 3), (1, 1, 300, 301, 1, 5),
                                   (4, 64, 28, 28, 64, 3), (2, 32, 40, 40, 32, 3)])
def test_cuda_paths(shape):
    """Seed's cases and depthwise 3x3 (the small-filter path), many channels (GEMM path)."""
    n, c, h, w_, oc, k = shape
    groups = c if shape[1] == 32 else 1
    x = torch.randn(n, c, h, w_, device="cuda", requires_grad=True)
    w = torch.randn(oc, c // groups, k, k, device="cuda", requires_grad=True)
    y = op(x, w, None, [1, 1], [k // 2, k // 2], [1, 1], groups)
    r = F.conv2d(x, w, None, 1, k // 2, 1, groups)
    _close(y, r, torch.float32, "output")
    go = torch.randn_like(r)
    for name, g, gr in zip(["grad_input", "grad_weight"], torch.autograd.grad(y, (x, w), go),
                           torch.autograd.grad(r, (x, w), go)):
        _close(g, gr, torch.float32, name)


@pytest.mark.sanitizer
def test_constant_filter_across_streams():
    """Launches with different filters on two streams must not see each other's
    (7x7: the general direct path, whose filter goes to __constant__ memory)."""
    x = torch.randn(1, 1, 1024, 1024, device="cuda")
    ws = [torch.randn(1, 1, 7, 7, device="cuda") for _ in range(8)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for i, w in enumerate(ws):
        with torch.cuda.stream(streams[i % 2]):
            outs.append(op(x, w, None, [1, 1], [3, 3]))
    torch.cuda.synchronize()
    for w, y in zip(ws, outs):
        _close(y, F.conv2d(x, w, None, 1, 3), torch.float32, "output")


# The small-filter path (kernels/common/conv_tile_small.h): 3x3 and 5x5 at
# stride 1 and dilation 1 with at most 4 input channels per group, its
# grad_input the same kernel over grad_output (padding <= K-1), its
# grad_weight in row runs. Sizes around its 32x32 tiles; (n, cin, cout,
# groups, h, w, k, padding, bias).
SMALL = [(1, 1, 1, 1, 33, 65, 3, (1, 1), True), (3, 1, 2, 1, 97, 31, 5, (2, 2), False),
         (2, 4, 4, 4, 32, 32, 3, (0, 2), True), (1, 8, 8, 2, 40, 31, 5, (4, 1), True),
         (0, 2, 2, 2, 9, 9, 3, (1, 1), True), (2, 3, 6, 3, 1, 1, 3, (1, 1), False),
         (1, 2, 3, 1, 70, 7, 5, (0, 0), True),
         (1, 1, 1, 1, 20, 20, 3, (3, 0), True)]  # padding > K-1: the general grad_input


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", SMALL, ids=[f"n{c[0]}c{c[1]}o{c[2]}g{c[3]}_{c[4]}x{c[5]}_k{c[6]}"
                                             f"p{c[7][0]}{c[7][1]}" for c in SMALL])
def test_cuda_small_filter_path(case, dtype):
    n, cin, cout, groups, h, w_, k, pad, bias = case
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, cin, h, w_ + 3, generator=gen, dtype=torch.float64)[..., 1:w_ + 1]
    x = x.to("cuda", dtype).requires_grad_()  # non-contiguous: a column slice
    wt = torch.randn(cout, cin // groups, k, k, generator=gen, dtype=torch.float64)
    wt = wt.to("cuda", dtype).requires_grad_()
    b = (torch.randn(cout, generator=gen, dtype=torch.float64).to("cuda", dtype).requires_grad_()
         if bias else None)
    ins = [x, wt] + ([b] if bias else [])
    y = op(x, wt, b, [1, 1], list(pad), [1, 1], groups)
    ref_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    refs = [t.detach().to(ref_dtype).requires_grad_() for t in ins]
    r = F.conv2d(refs[0], refs[1], refs[2] if bias else None, 1, pad, 1, groups)
    _close(y, r, dtype, "output")
    go = torch.randn(r.shape, generator=gen, dtype=torch.float64).to("cuda")
    got = torch.autograd.grad(y, ins, go.to(dtype))
    want = torch.autograd.grad(r, refs, go.to(ref_dtype))
    for name, g, gr in zip(["grad_input", "grad_weight", "grad_bias"], got, want):
        _close(g, gr, dtype, name)


def test_cuda_channels_last_and_unbatched():
    x = torch.randn(2, 8, 17, 17, device="cuda").contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 8, 3, 3, device="cuda")
    y, r = op(x, w, None, [1, 1], [1, 1]), F.conv2d(x, w, None, 1, 1)
    _close(y, r, torch.float32, "output")
    assert y.stride() == r.stride()
    _close(op(x[0], w, None, [1, 1], [1, 1]), F.conv2d(x[0], w, None, 1, 1), torch.float32, "3-D")


@pytest.mark.auto_path
@pytest.mark.parametrize("path", ["auto", "tiled"])
def test_cuda_direct_entry_equals_torch_ops(path, monkeypatch):
    """ddpx.ops.tiled_conv2d and ddpx.nn.TiledConv2d in eager mode reach the op
    through ddpx._C (plugin/python/fast_ops.cpp): the same outputs and
    gradients as torch.ops, on the path rule's choice and on our kernels."""
    monkeypatch.setenv("DDPX_CONV_PATH", path)
    import ddpx
    assert ddpx.ops._C is not None
    torch.manual_seed(0)
    x = torch.randn(4, 8, 19, 17, device="cuda", requires_grad=True)
    conv = ddpx.nn.TiledConv2d(8, 6, 3, padding=1, stride=(1, 2)).cuda()
    y = conv(x)
    want = op(x, conv.weight, conv.bias, [1, 2], [1, 1])
    go = torch.randn_like(y)
    params = (x, conv.weight, conv.bias)
    for got, ref in zip((y,) + torch.autograd.grad(y, params, go),
                        (want,) + torch.autograd.grad(want, params, go)):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(ddpx.ops.tiled_conv2d(x, conv.weight, conv.bias, (1, 2), 1), want,
                               rtol=0, atol=0)


# No input channels, an empty plane under padding: never cuDNN's (which does
# not compute them), and no zero-block launch for the empty gradients.
@pytest.mark.auto_path
@pytest.mark.parametrize("path", ["auto", "benchmark", "tiled", "aten"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", DEGENERATE, ids=[str(c[:2]) for c in DEGENERATE])
def test_cuda_degenerate_problem_on_every_path(case, dtype, path, monkeypatch):
    monkeypatch.setenv("DDPX_CONV_PATH", path)
    degenerate_case(case, "cuda", dtype)


def test_cuda_device_mismatch_is_named():
    with pytest.raises(RuntimeError, match="weight must be on the same device as input"):
        op(torch.randn(1, 1, 5, 5, device="cuda"), torch.randn(1, 1, 3, 3))


@pytest.mark.parametrize("cfg", GRADCHECK)
def test_cuda_gradcheck(cfg):
    gradcheck_case(cfg, "cuda")


@pytest.mark.parametrize("case", OPCHECK, ids=[str(i) for i in range(len(OPCHECK))])
def test_cuda_opcheck(case):
    opcheck_case(case, "cuda")


# ---- the path rule (kernels/common/tiled_conv2d_cuda_path.h) --------------------------------

RULE = [  # (N, Cin, H=W, Cout, k, groups) -> forward/backward path
    ((1, 1, 512, 1, 3, 1), "tiled/aten"),
    ((1, 1, 300, 1, 5, 1), "tiled"),
    ((1, 1, 64, 2, 7, 1), "tiled"),
    ((2, 1, 28, 6, 5, 1), "aten"),
    ((2, 32, 20, 32, 3, 32), "aten"),
    ((2, 16, 14, 16, 3, 1), "aten"),
]


@pytest.mark.auto_path
@pytest.mark.parametrize("shape,path", RULE, ids=[p + str(s) for s, p in RULE])
def test_cuda_auto_path_rule_and_results(shape, path):
    n, c, hw, oc, k, g = shape
    x = torch.randn(n, c, hw, hw, device="cuda", requires_grad=True)
    w = torch.randn(oc, c // g, k, k, device="cuda", requires_grad=True)
    b = torch.randn(oc, device="cuda", requires_grad=True)
    args = ([1, 1], [k // 2, k // 2], [1, 1], g)
    assert torch.ops.ddpx.tiled_conv2d_path(x, w, *args) == path
    y, r = op(x, w, b, *args), F.conv2d(x, w, b, 1, k // 2, 1, g)
    _close(y, r, torch.float32, "output")
    go = torch.randn_like(r)
    for name, got, ref in zip(["grad_input", "grad_weight", "grad_bias"],
                              torch.autograd.grad(y, (x, w, b), go),
                              torch.autograd.grad(r, (x, w, b), go)):
        _close(got, ref, torch.float32, name)


@pytest.mark.auto_path
def test_cuda_path_override(monkeypatch):
    x, w = torch.randn(2, 16, 14, 14, device="cuda"), torch.randn(16, 16, 3, 3, device="cuda")
    monkeypatch.setenv("DDPX_CONV_PATH", "tiled")
    assert torch.ops.ddpx.tiled_conv2d_path(x, w, [1, 1], [1, 1], [1, 1], 1) == "tiled"
    monkeypatch.setenv("DDPX_CONV_PATH", "aten")
    assert torch.ops.ddpx.tiled_conv2d_path(x, w, [1, 1], [1, 1], [1, 1], 1) == "aten"
    monkeypatch.setenv("DDPX_CONV_PATH", "sideways")
    with pytest.raises(RuntimeError, match="DDPX_CONV_PATH must be one of"):
        op(x, w, None, [1, 1], [1, 1])


# ---- benchmark mode: cuDNN or ours, measured per problem (conv_path_tuner.h) ---------------


@pytest.fixture
def cudnn_benchmark():
    was = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    yield
    torch.backends.cudnn.benchmark = was


def _passes(path):
    fwd, _, bwd = path.partition("/")
    return fwd, bwd or fwd


@pytest.mark.auto_path
@pytest.mark.parametrize("how", ["cudnn_benchmark", "env"])
@pytest.mark.parametrize("shape,path", RULE, ids=[p + str(s) for s, p in RULE])
def test_cuda_benchmark_mode(shape, path, how, request, monkeypatch):
    # torch.backends.cudnn.benchmark turns the rule into a measurement;
    # DDPX_CONV_PATH=benchmark does so whatever that flag says. The measuring
    # call returns the winner's result; later calls take the winner.
    if how == "cudnn_benchmark":
        monkeypatch.delenv("DDPX_CONV_PATH", raising=False)
        request.getfixturevalue("cudnn_benchmark")
    else:
        monkeypatch.setenv("DDPX_CONV_PATH", "benchmark")
    n, c, hw, oc, k, g = shape
    wide = hw + (3 if how == "env" else 1)  # problems of their own: choices live for the process
    x = torch.randn(n, c, hw, wide, device="cuda", requires_grad=True)
    w = torch.randn(oc, c // g, k, k, device="cuda", requires_grad=True)
    b = torch.randn(oc, device="cuda", requires_grad=True)
    args = ([1, 1], [k // 2, k // 2], [1, 1], g)
    assert torch.ops.ddpx.tiled_conv2d_path(x, w, *args) == "measure"
    r = F.conv2d(x, w, b, 1, k // 2, 1, g)
    go = torch.randn_like(r)
    refs = torch.autograd.grad(r, (x, w, b), go)
    for attempt in ("measuring", "measured"):
        y = op(x, w, b, *args)
        _close(y, r, torch.float32, f"{attempt} output")
        for name, got, ref in zip(["grad_input", "grad_weight", "grad_bias"],
                                  torch.autograd.grad(y, (x, w, b), go), refs):
            _close(got, ref, torch.float32, f"{attempt} {name}")
        assert set(_passes(torch.ops.ddpx.tiled_conv2d_path(x, w, *args))) <= {"aten", "tiled"}


@pytest.mark.auto_path
def test_cuda_benchmark_mode_under_graph_capture(monkeypatch):
    # Measuring syncs the device, which a capturing stream forbids: a problem
    # first met under capture takes the fixed rule, and stays unmeasured.
    x = torch.randn(2, 1, 40, 45, device="cuda")
    w = torch.randn(1, 1, 5, 5, device="cuda")
    # A warm-up outside the capture (lazy initialisation), with the path forced: not measured.
    monkeypatch.setenv("DDPX_CONV_PATH", "tiled")
    op(x, w, None, [1, 1], [2, 2])
    torch.cuda.synchronize()
    monkeypatch.setenv("DDPX_CONV_PATH", "benchmark")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = op(x, w, None, [1, 1], [2, 2])
    graph.replay()
    torch.cuda.synchronize()
    _close(y, F.conv2d(x, w, padding=2), torch.float32, "captured")
    assert torch.ops.ddpx.tiled_conv2d_path(x, w, [1, 1], [2, 2]) == "measure"
