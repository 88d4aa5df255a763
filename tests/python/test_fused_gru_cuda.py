"""ddpx::fused_gru's CUDA kernels (label gpu): against torch.nn.GRU on the same
GPU (cuDNN) and against our own CPU kernel; float16/bfloat16 against float32.
DDPX_GRU_PATH=fused runs the persistent recurrence where its plan fits (every
case of the suite, and sizes that take many blocks, batch chunks and, for
float32 at hidden 2048, the per-step fallback); DDPX_GRU_PATH=step the
per-step kernels.

Tolerances: float64 rtol 1e-7 / atol 1e-8 (cuDNN and cuBLAS sum in other
orders); float32 rtol 1e-3 / atol 1e-4 with TF32 off on both sides (cuDNN's
fused GEMMs still sum differently); float16 / bfloat16 against our float32
result at 2e-2 / 6e-2 absolute.
"""
import pytest
import torch
from torch.testing import assert_close

from conftest import needs_cuda
from test_fused_gru import (CONFIGS, GRADCHECK, OP, _cfg_id, copy_params, gradcheck_case,
                            make_gru, run_ours)

pytestmark = needs_cuda


@pytest.fixture(autouse=True)
def _no_tf32(request, monkeypatch):
    """cuDNN's GRU would use TF32 by default; ours (cuBLAS via ATen) follows
    torch.backends.cuda.matmul.allow_tf32, off by default. Our CUDA kernels
    on every test (the path rule sends CUDA calls to cuDNN, which would then
    be compared with itself) except those marked auto_path."""
    if "auto_path" not in request.keywords:
        monkeypatch.setenv("DDPX_GRU_PATH", "fused")
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


TOL = {torch.float64: dict(rtol=1e-7, atol=1e-8), torch.float32: dict(rtol=1e-3, atol=1e-4)}
CUDA_CONFIGS = CONFIGS  # the CPU suite, every case


def _inputs(cfg, device):
    L, bi, bf, bias, T, B, I, H, with_hx, noncontig, unbatched, dtype = cfg
    D = 2 if bi else 1
    x_shape = (T, I) if unbatched else ((B, T, I) if bf else (T, B, I))
    hx_shape = (L * D, H) if unbatched else (L * D, B, H)
    x = torch.randn(x_shape, dtype=dtype, device=device)
    if noncontig:
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    hx = torch.randn(hx_shape, dtype=dtype, device=device) if with_hx else None
    return x.requires_grad_(), (hx.requires_grad_() if hx is not None else None)


def _grads(y, h, wrt, gy, gh):
    return torch.autograd.grad((y * gy).sum() + (h * gh).sum(), wrt)


def _check_against_cudnn_gru(cfg, path=None):
    """Outputs and every gradient of ddpx::fused_gru against torch.nn.GRU's
    (cuDNN) on the GPU; `path`: what fused_gru_path must report."""
    torch.manual_seed(0)
    L, bi, bf, bias, T, B, I, H, *_ , dtype = cfg
    gru = make_gru(I, H, L, bias, bi, bf, dtype).cuda()
    x, hx = _inputs(cfg, "cuda")
    if path is not None:
        assert torch.ops.ddpx.fused_gru_path(x, H, bf) == path
    params = copy_params(gru)
    y_ref, h_ref = gru(x, hx)
    y, h = run_ours(gru, x, hx, params)
    assert_close(y, y_ref, **TOL[dtype])
    assert_close(h, h_ref, **TOL[dtype])
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    extra = [hx] if hx is not None else []
    g = _grads(y, h, [x, *extra, *params], gy, gh)
    g_ref = _grads(y_ref, h_ref, [x, *extra, *gru._flat_weights], gy, gh)
    for a, b in zip(g, g_ref):
        assert_close(a, b, **TOL[dtype])


@pytest.mark.parametrize("cfg", CUDA_CONFIGS, ids=[_cfg_id(c) for c in CUDA_CONFIGS])
def test_cuda_matches_cudnn_gru(cfg):
    _check_against_cudnn_gru(cfg, "persistent")


STEP_CONFIGS = CONFIGS[:7] + CONFIGS[-9:]  # the corners and some random ones


@pytest.mark.parametrize("cfg", STEP_CONFIGS, ids=[_cfg_id(c) for c in STEP_CONFIGS])
def test_cuda_step_kernels_match_cudnn_gru(cfg, monkeypatch):
    monkeypatch.setenv("DDPX_GRU_PATH", "step")
    _check_against_cudnn_gru(cfg, "step")


# The persistent plan at sizes the suite does not reach: 1024 hidden units on
# 128 blocks of 8, batch rows staged in chunks (backward: 8 of 64 at a time);
# bfloat16 at hidden 2048 (its weights fit on chip, float32's do not).
LARGE = [
    # layers, bidirectional, batch_first, bias, seq, batch, input, hidden, hx, noncontig, unbatched
    (1, True, False, True, 3, 64, 16, 1024, True, False, False, torch.float32),
    (2, False, True, True, 4, 5, 8, 256, False, False, False, torch.float32),
    (1, False, False, False, 3, 33, 4, 130, True, False, False, torch.float64),
]


@pytest.mark.parametrize("cfg", LARGE, ids=[_cfg_id(c) for c in LARGE])
def test_cuda_persistent_large_matches_cudnn_gru(cfg):
    _check_against_cudnn_gru(cfg, "persistent")


def test_cuda_persistent_plan_limits():
    x16 = torch.randn(3, 4, 8, device="cuda", dtype=torch.bfloat16)
    path = torch.ops.ddpx.fused_gru_path
    props = torch.cuda.get_device_properties(0)
    if props.multi_processor_count >= 128:  # (H100/H200: 16 units a block fit)
        assert path(x16, 2048, False) == "persistent"
    assert path(x16.float(), 2048, False) == "step"  # 384 KiB of weights per block
    torch.manual_seed(0)
    gru = make_gru(8, 2048, 1, dtype=torch.float32).cuda()
    x = torch.randn(3, 4, 8, device="cuda")
    y_ref, h_ref = gru(x)
    y, h = run_ours(gru, x, None, copy_params(gru))
    assert_close(y, y_ref, **TOL[torch.float32])
    assert_close(h, h_ref, **TOL[torch.float32])


@pytest.mark.sanitizer
@pytest.mark.parametrize("path", ["fused", "step"])
def test_cuda_matches_our_cpu_kernel_in_double(path, monkeypatch):
    monkeypatch.setenv("DDPX_GRU_PATH", path)
    torch.manual_seed(0)
    gru = make_gru(5, 17, 3, bidirectional=True, batch_first=True)
    x = torch.randn(4, 9, 5, dtype=torch.float64, requires_grad=True)
    params = copy_params(gru)
    y, h = run_ours(gru, x, None, params)
    g = _grads(y, h, [x, *params], torch.ones_like(y), torch.ones_like(h))
    xc = x.detach().cuda().requires_grad_()
    pc = [p.detach().cuda().requires_grad_() for p in params]
    yc, hc = run_ours(gru, xc, None, pc)
    gc = _grads(yc, hc, [xc, *pc], torch.ones_like(yc), torch.ones_like(hc))
    assert_close(yc.cpu(), y, rtol=1e-10, atol=1e-12)
    assert_close(hc.cpu(), h, rtol=1e-10, atol=1e-12)
    for a, b in zip(gc, g):
        assert_close(a.cpu(), b, rtol=1e-9, atol=1e-11)


@pytest.mark.sanitizer
@pytest.mark.parametrize("dtype,atol", [(torch.float16, 2e-2), (torch.bfloat16, 6e-2)])
def test_cuda_half_precision_close_to_float32(dtype, atol):
    torch.manual_seed(0)
    gru = make_gru(8, 16, 2, bidirectional=True, dtype=torch.float32).cuda()
    x = torch.randn(6, 4, 8, device="cuda", requires_grad=True)
    params = copy_params(gru)
    y32, h32 = run_ours(gru, x, None, params)
    g32 = _grads(y32, h32, [x, *params], torch.ones_like(y32), torch.ones_like(h32))
    xl = x.detach().to(dtype).requires_grad_()
    low = [p.detach().to(dtype).requires_grad_() for p in params]
    y, h = run_ours(gru, xl, None, low)
    assert y.dtype == dtype and h.dtype == dtype
    assert_close(y.float(), y32.detach(), rtol=0, atol=atol)
    assert_close(h.float(), h32.detach(), rtol=0, atol=atol)
    g = _grads(y, h, [xl, *low], torch.ones_like(y), torch.ones_like(h))
    for a, b in zip(g, g32):
        assert torch.isfinite(a).all()
        assert_close(a.float(), b, rtol=5e-2, atol=10 * atol)


def test_cuda_opcheck():
    torch.manual_seed(0)
    gru = make_gru(3, 4, 2, bidirectional=True).cuda()
    x = torch.randn(5, 2, 3, dtype=torch.float64, device="cuda", requires_grad=True)
    hx = torch.randn(4, 2, 4, dtype=torch.float64, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.ddpx.fused_gru.default,
                          (x, hx, copy_params(gru), True, 2, 0.0, False, True, False))


def test_cuda_dropout_rate():
    gru = make_gru(4, 16, 3, bidirectional=True, dtype=torch.float32).cuda()
    x = torch.randn(20, 8, 4, device="cuda")
    with torch.no_grad():
        masks = torch.ops.ddpx._fused_gru_forward(x, None, copy_params(gru), True, 3, 0.3, True,
                                                  True, False)[4]
    assert abs((masks == 0).double().mean().item() - 0.3) < 0.03


@pytest.mark.parametrize("layers,bidirectional,batch_first,bias,unbatched", GRADCHECK)
def test_cuda_gradcheck(layers, bidirectional, batch_first, bias, unbatched):
    gradcheck_case(layers, bidirectional, batch_first, bias, unbatched, "cuda")


# ---- the path rule (ops/fused_gru_cuda_path.h): cuDNN below hidden 128 ----------------------

@pytest.mark.auto_path
@pytest.mark.parametrize("cfg", CONFIGS[:12], ids=[_cfg_id(c) for c in CONFIGS[:12]])
def test_cuda_auto_path_is_cudnn_with_our_contract(cfg):
    _check_against_cudnn_gru(cfg, "cudnn")


@pytest.mark.auto_path
def test_cuda_auto_path_names_atens_own_gru(monkeypatch):
    """Under `cudnn`, at::gru runs cuDNN's RNN only where ATen's gate lets it
    (torch.cudnn_is_acceptable: cuDNN enabled; in torch 2.11 also float32,
    float64 or float16); elsewhere ATen's own GRU, and the path says so."""
    monkeypatch.delenv("DDPX_GRU_PATH", raising=False)
    path = torch.ops.ddpx.fused_gru_path
    x = torch.randn(5, 2, 3, device="cuda")
    assert path(x, 4, False) == "cudnn"
    with torch.backends.cudnn.flags(enabled=False):
        assert path(x, 4, False) == "aten"
    x16 = x.bfloat16()
    assert path(x16, 4, False) == ("cudnn" if torch.cudnn_is_acceptable(x16) else "aten")


@pytest.mark.auto_path
def test_cuda_auto_path_follows_the_measured_rule(monkeypatch):
    """`auto` runs our persistent kernel where the H200's measurements say it
    beats cuDNN (ops/fused_gru_cuda_path.h: float32, 16 steps or more, hidden
    >= 128, batch <= 4; batch <= 16 up to hidden 512 with TF32 off), cuDNN
    elsewhere; its result is nn.GRU's, gradients too."""
    monkeypatch.delenv("DDPX_GRU_PATH", raising=False)
    path = torch.ops.ddpx.fused_gru_path
    x = lambda b, t=20: torch.randn(t, b, 3, device="cuda")  # noqa: E731
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        assert path(x(2), 256, False) == "persistent"
        assert path(x(16), 512, False) == "persistent"
        assert path(x(16), 1024, False) == "cudnn"
        assert path(x(64), 256, False) == "cudnn"
        assert path(x(2), 64, False) == "cudnn"
        assert path(x(2).half(), 256, False) == "cudnn"
        assert path(x(2, 8), 256, False) == "cudnn"
        _check_against_cudnn_gru((2, True, True, True, 17, 3, 5, 130, True, False, False,
                                  torch.float32), "persistent")
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=True):
        assert path(x(2), 256, False) == "persistent"
        assert path(x(16), 512, False) == "cudnn"


@pytest.mark.auto_path
def test_cuda_path_override(monkeypatch):
    x = torch.randn(5, 2, 3, device="cuda")
    monkeypatch.setenv("DDPX_GRU_PATH", "fused")
    assert torch.ops.ddpx.fused_gru_path(x, 4, False) == "persistent"
    monkeypatch.setenv("DDPX_GRU_PATH", "step")
    assert torch.ops.ddpx.fused_gru_path(x, 4, False) == "step"
    monkeypatch.setenv("DDPX_GRU_PATH", "sideways")
    with pytest.raises(RuntimeError, match="DDPX_GRU_PATH must be one of"):
        torch.ops.ddpx.fused_gru_path(x, 4, False)


@pytest.mark.auto_path
def test_cuda_inference_mode_takes_the_path(monkeypatch):
    """torch.inference_mode skips the Autograd kernel, where the path of a
    training call is chosen: the backend kernel chooses it for inference.
    `cudnn`: nn.GRU's own result, bit for bit; `fused`: ours, close to it."""
    gru = make_gru(40, 48, 1, dtype=torch.float32).cuda().eval()  # (train=False, as the op's)
    x = torch.randn(12, 5, 40, device="cuda")
    params = [p.detach() for p in gru._flat_weights]
    with torch.inference_mode():
        want = gru(x)[0]
        for path in ("cudnn", "fused"):
            monkeypatch.setenv("DDPX_GRU_PATH", path)
            y = OP(x, None, params, True, 1, 0.0, False, False, False)[0]
            if path == "cudnn":
                assert torch.equal(y, want)
            else:
                assert_close(y, want, **TOL[torch.float32])


# ---- benchmark mode (ops/fused_gru_tune.h): cuDNN or ours, measured per problem ------------

@pytest.mark.auto_path
@pytest.mark.parametrize("how", ["env", "cudnn_benchmark"])
@pytest.mark.parametrize("cfg", CONFIGS[:6], ids=[_cfg_id(c) for c in CONFIGS[:6]])
def test_cuda_benchmark_mode(cfg, how, monkeypatch):
    """The measuring call and the next give nn.GRU's outputs and gradients,
    and the measurement's own backward leaves .grad alone (a loss's backward
    after it accumulates exactly one step's gradient)."""
    if how == "env":
        monkeypatch.setenv("DDPX_GRU_PATH", "benchmark")
    else:
        monkeypatch.delenv("DDPX_GRU_PATH", raising=False)
        monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    L, bi, bf, bias, T, B, I, H, *_, dtype = cfg
    x, _ = _inputs(cfg, "cuda")
    assert torch.ops.ddpx.fused_gru_path(x, H, bf) == "benchmark"
    for _ in range(2):  # measured, then the kept choice
        _check_against_cudnn_gru(cfg)
    torch.manual_seed(1)
    gru = make_gru(I, H, L, bias, bi, bf, dtype).cuda()
    x, hx = _inputs(cfg, "cuda")
    params = copy_params(gru)
    y, h = run_ours(gru, x, hx, params)
    (y.sum() + h.sum()).backward()
    y_ref, h_ref = gru(x.detach(), hx.detach() if hx is not None else None)
    want = torch.autograd.grad(y_ref.sum() + h_ref.sum(), gru._flat_weights)
    for p, w in zip(params, want):
        assert_close(p.grad, w, **TOL[dtype])


@pytest.mark.auto_path
def test_cuda_benchmark_mode_with_per_op_tf32(monkeypatch):
    """PyTorch's per-op TF32 settings with conv's and RNN's apart, where
    asking cuDNN's flag without naming the op is an error: the measured
    choice's key asks RNN's."""
    monkeypatch.setenv("DDPX_GRU_PATH", "benchmark")
    gru = make_gru(11, 13, 1, dtype=torch.float32).cuda()
    x = torch.randn(7, 2, 11, device="cuda")
    params = [p.detach() for p in gru._flat_weights]
    torch.backends.cudnn.conv.fp32_precision = "tf32"  # RNN's stays "ieee" (the fixture's)
    try:
        with torch.no_grad():
            for _ in range(2):  # measured, then the kept choice
                y = OP(x, None, params, True, 1, 0.0, False, False, False)[0]
                assert_close(y, gru(x)[0], **TOL[torch.float32])
    finally:
        torch.backends.cudnn.allow_tf32 = False  # (the legacy setter sets both again)


@pytest.mark.auto_path
def test_cuda_benchmark_mode_under_graph_capture(monkeypatch):
    """A problem not measured yet, met while a CUDA graph is captured (no
    syncs allowed), takes the fixed rule (cuDNN) and is measured later."""
    monkeypatch.setenv("DDPX_GRU_PATH", "benchmark")
    gru = make_gru(7, 9, 1, dtype=torch.float32).cuda()
    x = torch.randn(6, 3, 7, device="cuda")
    params = [p.detach() for p in gru._flat_weights]
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            y, _ = OP(x, None, params, True, 1, 0.0, False, False, False)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(y, gru(x)[0], **TOL[torch.float32])
        y2, _ = OP(x, None, params, True, 1, 0.0, False, False, False)  # measured now
        assert_close(y2, y, **TOL[torch.float32])
