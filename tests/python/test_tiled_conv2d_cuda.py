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


def _on_cuda(x, dtype):
    """x on the GPU in dtype with x's strides: .to() would make a
    non-contiguous input dense, and the case would test another layout."""
    return torch.empty_strided(x.size(), x.stride(), dtype=dtype, device="cuda").copy_(x)


def _channels_last(t):
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


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
    x = _on_cuda(_make_input(c, torch.float64, gen).detach(), dtype).requires_grad_()
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
    if ref_dtype == dtype and r.numel() > 1 and min(r.shape) > 1:
        # The layout F.conv2d gives (strides are ambiguous on size-1 dims).
        assert y.stride() == r.stride(), f"strides {y.stride()} != ATen's {r.stride()}"
    go = torch.randn(r.shape, generator=gen, dtype=torch.float64).to("cuda")
    ins, rins = [x, w] + ([b] if b is not None else []), [xr, wr] + ([br] if br is not None else [])
    got = torch.autograd.grad(y, ins, go.to(dtype))
    ref = torch.autograd.grad(r, rins, go.to(ref_dtype))
    for name, g, gr in zip(["grad_input", "grad_weight", "grad_bias"], got, ref):
        _close(g, gr, dtype, name)


@pytest.mark.sanitizer
@pytest.mark.parametrize("shape", [(1, 1, 512, 512, 1, 3, 1, False), (1, 1, 300, 301, 1, 5, 1, False),
                                   (4, 64, 28, 28, 64, 3, 1, False), (2, 32, 40, 40, 32, 3, 1, False),
                                   (2, 32, 40, 41, 32, 7, 2, False), (2, 40, 30, 29, 40, 7, 2, True),
                                   (2, 40, 30, 29, 40, 3, 1, True)])
def test_cuda_paths(shape):
    """Seed's cases and depthwise (the small-filter kernels: NCHW, channels_last,
    stride 2), many channels (GEMM path)."""
    n, c, h, w_, oc, k, s, cl = shape
    groups = c if c in (32, 40) else 1
    x = torch.randn(n, c, h, w_, device="cuda")
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    w = torch.randn(oc, c // groups, k, k, device="cuda", requires_grad=True)
    y = op(x, w, None, [s, s], [k // 2, k // 2], [1, 1], groups)
    r = F.conv2d(x, w, None, s, k // 2, 1, groups)
    _close(y, r, torch.float32, "output")
    go = torch.randn_like(r)
    for name, g, gr in zip(["grad_input", "grad_weight"], torch.autograd.grad(y, (x, w), go),
                           torch.autograd.grad(r, (x, w), go)):
        _close(g, gr, torch.float32, name)


@pytest.mark.sanitizer
def test_constant_filter_across_streams():
    """Launches with different filters on two streams must not see each other's
    (7x5: the general direct path, whose filter goes to __constant__ memory)."""
    x = torch.randn(1, 1, 1024, 1024, device="cuda")
    ws = [torch.randn(1, 1, 7, 5, device="cuda") for _ in range(8)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())  # x and ws were made on this one
    outs = []
    for i, w in enumerate(ws):
        with torch.cuda.stream(streams[i % 2]):
            outs.append(op(x, w, None, [1, 1], [3, 2]))
    torch.cuda.synchronize()
    for w, y in zip(ws, outs):
        _close(y, F.conv2d(x, w, None, 1, (3, 2)), torch.float32, "output")


# The small-filter kernels (kernels/cuda/conv_small_kernel.cu): square 3x3,
# 5x5, 7x7 at stride 1 or 2 and dilation 1 with at most 4 input channels per
# group; grad_input a forward over grad_output (stride 1, padding <= K-1) or a
# gather, grad_weight partial sums on the forward's blocks; channels_last
# depthwise (one filter per channel) in its own NHWC kernels. Sizes around
# their 32x32 tiles and 32-channel blocks; NCHW inputs are a column slice
# (non-contiguous). (n, cin, cout, groups, h, w, k, stride, padding, bias,
# channels_last)
SMALL = [(1, 1, 1, 1, 33, 65, 3, 1, (1, 1), True, False),
         (3, 1, 2, 1, 97, 31, 5, 1, (2, 2), False, False),
         (2, 4, 4, 4, 32, 32, 3, 1, (0, 2), True, False),
         (1, 8, 8, 2, 40, 31, 5, 1, (4, 1), True, False),
         (0, 2, 2, 2, 9, 9, 3, 1, (1, 1), True, False),
         (2, 3, 6, 3, 1, 1, 3, 1, (1, 1), False, False),
         (1, 2, 3, 1, 70, 7, 5, 1, (0, 0), True, False),
         (1, 1, 1, 1, 20, 20, 3, 1, (3, 0), True, False),  # padding > K-1: the gather
         (2, 5, 5, 5, 45, 37, 7, 1, (3, 3), True, False),  # depthwise 7x7
         (2, 3, 3, 3, 70, 67, 3, 2, (1, 1), False, False),  # stride 2, odd sizes
         (1, 2, 4, 2, 69, 66, 5, 2, (2, 2), True, False),  # multiplier 2, stride 2
         (2, 2, 2, 2, 41, 80, 7, 2, (3, 3), True, False),
         (2, 40, 40, 40, 19, 21, 3, 1, (1, 1), True, True),  # channels_last, 2 channel blocks
         (1, 33, 33, 33, 28, 30, 5, 2, (2, 2), False, True),
         (2, 8, 8, 8, 17, 12, 7, 2, (3, 3), True, True),
         (1, 6, 6, 6, 12, 10, 7, 1, (3, 3), True, True),
         (2, 3, 3, 3, 6, 9, 3, 1, (3, 2), True, True),  # padding > K-1: the NHWC gather
         (0, 4, 4, 4, 9, 9, 3, 2, (1, 1), True, True)]


def _small_id(c):
    n, cin, cout, groups, h, w, k, s, p, _, cl = c
    return f"n{n}c{cin}o{cout}g{groups}_{h}x{w}_k{k}s{s}p{p[0]}{p[1]}" + ("_cl" if cl else "")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", SMALL, ids=[_small_id(c) for c in SMALL])
def test_cuda_small_filter_path(case, dtype):
    n, cin, cout, groups, h, w_, k, stride, pad, bias, cl = case
    gen = torch.Generator().manual_seed(5)
    if cl:
        x = torch.randn(n, cin, h, w_, generator=gen, dtype=torch.float64).to("cuda", dtype)
        x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    else:
        # non-contiguous: a column slice, made on the device (.to() of a
        # slice would copy it dense)
        x = torch.randn(n, cin, h, w_ + 3, generator=gen, dtype=torch.float64)
        x = x.to("cuda", dtype)[..., 1:w_ + 1].requires_grad_()
    wt = torch.randn(cout, cin // groups, k, k, generator=gen, dtype=torch.float64)
    wt = wt.to("cuda", dtype).requires_grad_()
    b = (torch.randn(cout, generator=gen, dtype=torch.float64).to("cuda", dtype).requires_grad_()
         if bias else None)
    ins = [x, wt] + ([b] if bias else [])
    y = op(x, wt, b, [stride, stride], list(pad), [1, 1], groups)
    ref_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    refs = [t.detach().to(ref_dtype).requires_grad_() for t in ins]
    r = F.conv2d(refs[0], refs[1], refs[2] if bias else None, stride, pad, 1, groups)
    _close(y, r, dtype, "output")
    # The layout F.conv2d gives (channels_last, but NCHW in float64 on CUDA;
    # an empty tensor is never channels_last)
    if cl and y.numel():
        assert _channels_last(y) == _channels_last(r) == (dtype != torch.float64), "output layout"
    go = torch.randn(r.shape, generator=gen, dtype=torch.float64).to("cuda")
    got = torch.autograd.grad(y, ins, go.to(dtype))
    want = torch.autograd.grad(r, refs, go.to(ref_dtype))
    for name, g, gr in zip(["grad_input", "grad_weight", "grad_bias"], got, want):
        _close(g, gr, dtype, name)
    if cl and got[0].numel():
        assert _channels_last(got[0]) == _channels_last(want[0]) == (dtype != torch.float64), \
            "grad_input layout"


@pytest.mark.parametrize("case", [(2, 3, 3, 9, 11, 3, 2, 1, False), (1, 4, 4, 8, 9, 7, 2, 3, True),
                                  (2, 5, 5, 7, 6, 5, 1, 2, True), (1, 2, 4, 10, 7, 7, 2, 3, False)],
                         ids=["nchw3s2", "cl7s2", "cl5s1", "mult2_7s2"])
def test_cuda_small_filter_gradcheck(case):
    n, cin, cout, h, w_, k, stride, pad, cl = case
    x = torch.randn(n, cin, h, w_, device="cuda", dtype=torch.float64)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    wt = torch.randn(cout, 1, k, k, device="cuda", dtype=torch.float64)
    b = torch.randn(cout, device="cuda", dtype=torch.float64)
    ins = [t.requires_grad_() for t in (x, wt, b)]
    assert torch.autograd.gradcheck(
        lambda a, w, bb: op(a, w, bb, [stride, stride], [pad, pad], [1, 1], cin), ins)


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
    gradients as torch.ops, on the path rule's choice and on our kernels.
    (Bit for bit: cuDNN's deterministic algorithms, where the rule hands it
    the call; some of its backward ones add with atomics otherwise.)"""
    monkeypatch.setenv("DDPX_CONV_PATH", path)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
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


def test_cuda_opcheck_float64_channels_last():
    """float64 channels_last (OPCHECK[0]): ATen's output on CUDA is NCHW
    (cuDNN turns NHWC off for double), and so must the Meta kernel's be for a
    fake CUDA tensor, which reports device meta there."""
    opcheck_case(OPCHECK[0], "cuda", torch.float64)


# ---- the path rule (kernels/common/tiled_conv2d_cuda_path.h) --------------------------------

RULE = [  # (N, Cin, H=W, Cout, k, groups, stride, channels_last) -> forward/backward path
    ((1, 1, 512, 1, 3, 1, 1, False), "tiled"),
    ((1, 1, 300, 1, 5, 1, 1, False), "tiled"),
    ((1, 1, 64, 2, 7, 1, 1, False), "tiled"),
    ((2, 1, 28, 6, 5, 1, 1, False), "tiled/aten"),
    ((2, 32, 20, 32, 3, 32, 1, False), "aten"),
    ((2, 32, 50, 32, 3, 32, 2, False), "tiled"),
    ((2, 32, 20, 32, 3, 32, 2, False), "aten"),  # (NCHW, 10x10 outputs: under half a tile)
    ((2, 32, 20, 32, 3, 32, 2, True), "aten"),
    ((2, 24, 21, 24, 5, 24, 2, True), "tiled"),
    ((2, 16, 27, 16, 7, 16, 1, False), "tiled"),
    ((2, 16, 19, 16, 7, 16, 1, False), "aten"),
    ((2, 16, 19, 16, 7, 16, 1, True), "tiled"),
    ((2, 16, 14, 16, 3, 1, 1, False), "aten"),
]


@pytest.mark.auto_path
@pytest.mark.parametrize("shape,path", RULE, ids=[p + str(s) for s, p in RULE])
def test_cuda_auto_path_rule_and_results(shape, path):
    n, c, hw, oc, k, g, s, cl = shape
    fmt = torch.channels_last if cl else torch.contiguous_format
    x = torch.randn(n, c, hw, hw, device="cuda").to(memory_format=fmt).requires_grad_()
    w = torch.randn(oc, c // g, k, k, device="cuda").to(memory_format=fmt).requires_grad_()
    b = torch.randn(oc, device="cuda", requires_grad=True)
    args = ([s, s], [k // 2, k // 2], [1, 1], g)
    assert torch.ops.ddpx.tiled_conv2d_path(x, w, *args) == path
    y, r = op(x, w, b, *args), F.conv2d(x, w, b, s, k // 2, 1, g)
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
    n, c, hw, oc, k, g, s, cl = shape
    fmt = torch.channels_last if cl else torch.contiguous_format
    wide = hw + (3 if how == "env" else 1)  # problems of their own: choices live for the process
    x = torch.randn(n, c, hw, wide, device="cuda").to(memory_format=fmt).requires_grad_()
    w = torch.randn(oc, c // g, k, k, device="cuda").to(memory_format=fmt).requires_grad_()
    b = torch.randn(oc, device="cuda", requires_grad=True)
    args = ([s, s], [k // 2, k // 2], [1, 1], g)
    assert torch.ops.ddpx.tiled_conv2d_path(x, w, *args) == "measure"
    r = F.conv2d(x, w, b, s, k // 2, 1, g)
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


def test_cuda_constant_filter_under_graph_capture():
    # A filter the small kernels do not serve (7x5, one channel) takes the
    # direct path with its filter in __constant__ memory, whose copies an
    # event recorded outside captures orders; captured, the filter goes
    # through shared memory instead, and the calls before and after the
    # capture still run.
    x = torch.randn(2, 1, 33, 30, device="cuda")
    w = torch.randn(1, 1, 7, 5, device="cuda")
    want = F.conv2d(x, w, padding=(3, 2))
    _close(op(x, w, None, [1, 1], [3, 2]), want, torch.float32, "before the capture")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = op(x, w, None, [1, 1], [3, 2])
    graph.replay()
    _close(op(x, w, None, [1, 1], [3, 2]), want, torch.float32, "after the capture")
    torch.cuda.synchronize()
    _close(y, want, torch.float32, "captured")
