"""ddpx::tiled_conv2d's CPU paths (issue 26): each of direct, gemm and aten is
correct on its own (forced with DDPX_CONV_PATH), the automatic choice follows
the table of kernels/cpu/tiled_conv2d_path.h, benchmark mode measures the
three per problem (kernels/common/conv_path_tuner.h), and
ddpx::tiled_conv2d_path reports the choice.

Tolerances as in test_tiled_conv2d.py: rtol = atol / max(1, max|ref|) = 1e-9 in
float64, 1e-4 in float32 (only the summation order differs from ATen).
"""
import pytest
import torch
import torch.nn.functional as F

op = torch.ops.ddpx.tiled_conv2d
path_of = torch.ops.ddpx.tiled_conv2d_path
TOL = {torch.float64: 1e-9, torch.float32: 1e-4}
PATHS = ["direct", "gemm", "aten"]


def assert_close(got, ref, dtype, what):
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    tol = TOL[dtype]
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


# (name, input shape, weight shape, stride, padding, dilation, groups, layout)
CASES = [
    ("single_97x17_k3", (2, 1, 97, 17), (1, 1, 3, 3), 1, 1, 1, 1, "contiguous"),
    ("lenet1_odd", (3, 1, 17, 13), (6, 1, 5, 5), 1, 2, 1, 1, "noncontiguous"),
    ("lenet2_b1", (1, 6, 14, 14), (16, 6, 5, 5), 1, 0, 1, 1, "contiguous"),
    ("depthwise_k5_cl", (2, 8, 17, 19), (8, 1, 5, 5), 1, 2, 1, 8, "channels_last"),
    ("grouped_strided", (2, 6, 13, 11), (4, 3, 3, 2), (2, 1), (1, 0), (1, 2), 2, "noncontiguous"),
    ("resnet_like", (2, 16, 9, 9), (8, 16, 3, 3), 1, 1, 1, 1, "channels_last"),
    ("pointwise", (2, 12, 5, 7), (5, 12, 1, 1), 1, 0, 1, 1, "contiguous"),
    ("unbatched", (5, 8, 7), (3, 5, 3, 3), 2, 1, 1, 1, "contiguous"),
    ("empty_batch", (0, 6, 8, 8), (4, 6, 3, 3), 1, 1, 1, 1, "contiguous"),
    ("batch1_size1", (1, 1, 1, 1), (2, 1, 1, 1), 1, 0, 1, 1, "contiguous"),
]


def _pair(v):
    return list(v) if isinstance(v, tuple) else [v, v]


def _input(shape, layout, dtype, gen):
    if layout == "noncontiguous":
        x = torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype, generator=gen)[..., ::2]
    else:
        x = torch.randn(*shape, dtype=dtype, generator=gen)
        if layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("path", PATHS)
def test_forced_path_matches_aten(path, case, dtype, monkeypatch):
    monkeypatch.setenv("DDPX_CONV_PATH", path)
    _, xs, ws, s, p, d, g, layout = case
    gen = torch.Generator().manual_seed(len(case[0]))
    x = _input(xs, layout, dtype, gen)
    w = torch.randn(ws, dtype=dtype, generator=gen, requires_grad=True)
    b = torch.randn(ws[0], dtype=dtype, generator=gen, requires_grad=True)
    args = (_pair(s), _pair(p), _pair(d), g)
    assert path_of(x, w, *args) == path
    y = op(x, w, b, *args)
    r = F.conv2d(x, w, b, *args)
    assert_close(y, r, dtype, "output")
    if r.numel() > 1 and min(r.shape) > 1:
        assert y.stride() == r.stride(), f"strides {y.stride()} != ATen's {r.stride()}"
    go = torch.randn(r.shape, dtype=dtype, generator=gen)
    for name, got, ref in zip(["grad_input", "grad_weight", "grad_bias"],
                              torch.autograd.grad(y, (x, w, b), go),
                              torch.autograd.grad(r, (x, w, b), go)):
        assert_close(got, ref, dtype, name)


@pytest.mark.parametrize("path", PATHS + ["benchmark"])  # (benchmark: measured in the first call)
def test_path_gradcheck(path, monkeypatch):
    monkeypatch.setenv("DDPX_CONV_PATH", path)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, 6, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(4, 3, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: op(x, w, b, [1, 2], [0, 1], [1, 2], 2),
                                    (x, w, b))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("cin,groups", [(6, 1), (6, 6), (1, 1)], ids=["plain", "depthwise", "single"])
@pytest.mark.parametrize("path", PATHS)
def test_forced_path_opcheck(path, cin, groups, layout, monkeypatch):
    # The Meta kernels must predict each path's output strides (ATen's own for
    # the aten path), for the forward and the backward op.
    monkeypatch.setenv("DDPX_CONV_PATH", path)
    x = torch.randn(2, cin, 9, 8)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    cout = 4 if groups == 1 else cin
    w = torch.randn(cout, cin // groups, 3, 3)
    b = torch.randn(cout, requires_grad=True)
    args = ([1, 1], [1, 1], [1, 1], groups)
    torch.library.opcheck(op, (x.clone().requires_grad_(), w.clone().requires_grad_(), b, *args))
    go = torch.randn(2, cout, 9, 8)
    torch.library.opcheck(torch.ops.ddpx._tiled_conv2d_backward,
                          (go, x, w, *args, [True, True, True]))


@pytest.mark.parametrize("path", PATHS)
def test_forced_path_output_mask(path, monkeypatch):
    monkeypatch.setenv("DDPX_CONV_PATH", path)
    x, w, go = torch.randn(2, 6, 7, 7), torch.randn(4, 6, 3, 3), torch.randn(2, 4, 5, 5)
    for mask in ([True, False, False], [False, True, False], [False, False, True]):
        got = torch.ops.ddpx._tiled_conv2d_backward(go, x, w, [1, 1], [0, 0], [1, 1], 1, mask)
        ref = torch.ops.aten.convolution_backward(go, x, w, [4], [1, 1], [0, 0], [1, 1], False,
                                                  [0, 0], 1, mask)
        for want, g, r in zip(mask, got, ref):
            assert (g is not None) == want
            if want:
                torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_double_backward_on_aten_path_is_atens(monkeypatch):
    # Where ATen serves both passes, the Autograd kernel hands the call to
    # at::convolution with autograd on: ATen's backward node is recorded (not
    # ours), so double backward works there, and matches F.conv2d's.
    monkeypatch.setenv("DDPX_CONV_PATH", "aten")
    x = torch.randn(1, 4, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)
    y = op(x, w, b, [1, 1], [1, 1], [1, 1], 1)
    assert "Convolution" in type(y.grad_fn).__name__
    assert torch.autograd.gradgradcheck(
        lambda x, w, b: op(x, w, b, [1, 1], [1, 1], [1, 1], 1), (x, w, b))
    # Unbatched input takes the same route and keeps its 3-D shape.
    y3 = op(x[0], w, b, [1, 1], [1, 1], [1, 1], 1)
    torch.testing.assert_close(y3, F.conv2d(x[0], w, b, padding=1))


@pytest.mark.parametrize("path", ["auto"] + PATHS)
def test_inference_records_nothing(path, monkeypatch):
    # no_grad (or nothing requiring grad) skips our Function, and an ATen
    # forward is called directly: same values, no graph.
    monkeypatch.setenv("DDPX_CONV_PATH", path)
    for x, w in ((torch.randn(64, 1, 28, 28), torch.randn(6, 1, 5, 5)),   # aten/direct under auto
                 (torch.randn(2, 6, 9, 8), torch.randn(4, 6, 3, 3))):
        b = torch.randn(w.shape[0])
        ref = F.conv2d(x, w, b, padding=1)
        with torch.no_grad():
            got = op(x.requires_grad_(), w.requires_grad_(), b, [1, 1], [1, 1], [1, 1], 1)
        assert got.grad_fn is None and not got.requires_grad
        assert_close(got, ref, torch.float32, path)
        got = op(x.detach(), w.detach(), b, [1, 1], [1, 1], [1, 1], 1)
        assert got.grad_fn is None
        assert_close(got, ref, torch.float32, path)


def test_double_backward_fails_clearly_where_a_pass_is_ours(monkeypatch):
    # Forward by ATen, backward by the direct loops: our backward op is in the
    # graph, and differentiating it again says so.
    monkeypatch.setenv("DDPX_CONV_PATH", "auto")
    x = torch.randn(64, 1, 28, 28, requires_grad=True)
    w = torch.randn(6, 1, 5, 5, requires_grad=True)
    assert path_of(x, w) == "aten/direct"
    (gx,) = torch.autograd.grad(op(x, w).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward of ddpx::tiled_conv2d"):
        gx.sum().backward()


# ---- the automatic choice --------------------------------------------------------------

# (input shape [+ "cl": channels_last], weight shape, groups, dtype, expected
# path); stride 1, "same" padding. "a/b" is forward a, backward b.
AUTO = [
    ((1, 1, 512, 512), (1, 1, 3, 3), 1, torch.float32, "direct"),  # the seed's images
    ((1, 1, 2048, 2048), (1, 1, 5, 5), 1, torch.float32, "direct"),
    ((1, 1, 28, 28), (6, 1, 5, 5), 1, torch.float32, "direct"),  # LeNet conv1, batch 1
    ((64, 1, 28, 28), (6, 1, 5, 5), 1, torch.float32, "aten/direct"),  # batch 64
    ((1, 6, 14, 14), (16, 6, 5, 5), 1, torch.float32, "gemm"),  # LeNet conv2, batch 1
    ((64, 6, 14, 14), (16, 6, 5, 5), 1, torch.float32, "aten"),  # batch 64
    ((8, 32, 56, 56), (32, 1, 3, 3), 32, torch.float32, "aten"),  # depthwise
    ((8, 32, 56, 56), (32, 1, 5, 5), 32, torch.float32, "aten/direct"),
    ((8, 96, 56, 56, "cl"), (96, 1, 7, 7), 96, torch.float32, "aten"),  # channels_last
    ((1, 4, 16, 16, "cl"), (4, 1, 5, 5), 4, torch.float32, "direct"),  # (small: ours)
    ((1, 4, 16, 16), (4, 1, 5, 5), 4, torch.float32, "direct"),  # small depthwise
    ((1, 4, 16, 16), (4, 1, 3, 3), 4, torch.float32, "direct"),
    ((8, 64, 56, 56), (64, 64, 3, 3), 1, torch.float32, "aten"),  # ResNet
    ((2, 2, 9, 9), (2, 2, 3, 3), 1, torch.float64, "direct"),  # float64: the seed's rule
    ((2, 8, 9, 9), (2, 8, 3, 3), 1, torch.float64, "gemm"),
]


@pytest.mark.parametrize("case", AUTO, ids=[f"{c[0]}-{c[1]}-g{c[2]}-{c[3]}" for c in AUTO])
def test_auto_path(case, monkeypatch):
    monkeypatch.delenv("DDPX_CONV_PATH", raising=False)
    xs, ws, g, dtype, want = case
    cl = xs[-1] == "cl"
    x, w = torch.empty(xs[:4], dtype=dtype), torch.empty(ws, dtype=dtype)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    pad = ws[-1] // 2
    assert path_of(x, w, [1, 1], [pad, pad], [1, 1], g) == want


def test_tiled_override_is_the_seed_rule(monkeypatch):
    monkeypatch.setenv("DDPX_CONV_PATH", "tiled")
    x4, x5 = torch.empty(1, 4, 8, 8), torch.empty(1, 5, 8, 8)
    assert path_of(x4, torch.empty(3, 4, 3, 3)) == "direct"
    assert path_of(x5, torch.empty(3, 5, 3, 3)) == "gemm"


def test_bad_path_override_names_the_variable(monkeypatch):
    monkeypatch.setenv("DDPX_CONV_PATH", "winograd")
    with pytest.raises(RuntimeError, match="DDPX_CONV_PATH must be one of"):
        op(torch.randn(1, 1, 5, 5), torch.randn(1, 1, 3, 3))


@pytest.mark.parametrize("path", PATHS + ["benchmark"])
def test_bad_arguments_name_the_argument_on_every_path(path, monkeypatch):
    # The checks run at the door, before the path is chosen.
    monkeypatch.setenv("DDPX_CONV_PATH", path)
    x = torch.randn(1, 4, 8, 8)
    with pytest.raises(RuntimeError, match="weight must be 4-D"):
        op(x, torch.randn(2, 4, 3))
    with pytest.raises(RuntimeError, match="bias must have out_channels"):
        op(x, torch.randn(2, 4, 3, 3), torch.randn(3))
    with pytest.raises(RuntimeError, match=r"weight.size\(1\) \* groups"):
        path_of(x, torch.randn(2, 3, 3, 3))
    with pytest.raises(RuntimeError, match="grad_output must have the forward output's shape"):
        torch.ops.ddpx._tiled_conv2d_backward(torch.randn(1, 2, 5, 5), x, torch.randn(2, 4, 3, 3),
                                              [1, 1], [0, 0], [1, 1], 1, [True, True, True])


# ---- benchmark mode: the path measured per problem --------------------------------------
# Measured choices live for the process, so each test below uses shapes of
# its own (the width) where it asserts that a problem is not measured yet.

MEASURED = {"direct", "gemm", "aten"}


def _passes(path):
    fwd, _, bwd = path.partition("/")
    return fwd, bwd or fwd


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_benchmark_mode_matches_aten(case, dtype, monkeypatch):
    # The measuring call itself returns the winner's result; later calls take
    # the winner straight away. Both agree with F.conv2d.
    monkeypatch.setenv("DDPX_CONV_PATH", "benchmark")
    _, xs, ws, s, p, d, g, layout = case
    gen = torch.Generator().manual_seed(len(case[0]) + 1)
    x = _input(xs, layout, dtype, gen)
    w = torch.randn(ws, dtype=dtype, generator=gen, requires_grad=True)
    b = torch.randn(ws[0], dtype=dtype, generator=gen, requires_grad=True)
    args = (_pair(s), _pair(p), _pair(d), g)
    r = F.conv2d(x, w, b, *args)
    go = torch.randn(r.shape, dtype=dtype, generator=gen)
    refs = torch.autograd.grad(r, (x, w, b), go)
    for attempt in ("measuring", "measured"):
        y = op(x, w, b, *args)
        assert_close(y, r, dtype, f"{attempt} output")
        for name, got, ref in zip(["grad_input", "grad_weight", "grad_bias"],
                                  torch.autograd.grad(y, (x, w, b), go), refs):
            assert_close(got, ref, dtype, f"{attempt} {name}")
        assert set(_passes(path_of(x, w, *args))) <= MEASURED


def test_benchmark_mode_measures_each_pass_once(monkeypatch):
    monkeypatch.setenv("DDPX_CONV_PATH", "benchmark")
    x = torch.randn(2, 3, 11, 101, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    assert path_of(x, w) == "measure"
    with torch.no_grad():
        op(x, w)                                   # the forward alone
    fwd, bwd = _passes(path_of(x, w))
    assert fwd in MEASURED and bwd == "measure"
    op(x, w).sum().backward()
    fwd2, bwd2 = _passes(path_of(x, w))
    assert fwd2 == fwd and bwd2 in MEASURED
    # Another thread count is another problem on the CPU (ours and oneDNN's
    # scale differently), and so is another dtype.
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert path_of(x, w) == "measure"
    finally:
        torch.set_num_threads(threads)
    assert path_of(x.double(), w.double()) == "measure"
    assert _passes(path_of(x, w)) == (fwd, bwd2)


def test_benchmark_mode_leaves_the_slow_path(monkeypatch):
    # 64 input channels, 3x3: the direct loops are 5-28x ATen's and the GEMM's
    # (kernels/cpu/tiled_conv2d_path.h), a margin no timing noise crosses.
    monkeypatch.setenv("DDPX_CONV_PATH", "benchmark")
    x = torch.randn(2, 64, 28, 27)
    w = torch.randn(64, 64, 3, 3)
    with torch.no_grad():
        y = op(x, w, None, [1, 1], [1, 1])
    assert_close(y, F.conv2d(x, w, padding=1), torch.float32, "output")
    assert _passes(path_of(x, w, [1, 1], [1, 1]))[0] in {"gemm", "aten"}


def test_benchmark_mode_in_torchscript(monkeypatch):
    # ddpx-train's models call the op from TorchScript: the same kernels measure.
    monkeypatch.setenv("DDPX_CONV_PATH", "benchmark")

    @torch.jit.script
    def conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.ddpx.tiled_conv2d(x, w, None, [1, 1], [2, 2], [1, 1], 1)

    x, w = torch.randn(3, 1, 19, 103), torch.randn(6, 1, 5, 5)
    assert path_of(x, w, [1, 1], [2, 2]) == "measure"
    assert_close(conv(x, w), F.conv2d(x, w, padding=2), torch.float32, "scripted")
    assert _passes(path_of(x, w, [1, 1], [2, 2]))[0] in MEASURED
