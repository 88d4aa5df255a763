import torch


def test_version_op_is_registered():
    v = torch.ops.ddpx.version()
    assert isinstance(v, str) and v.count(".") == 2


def test_version_op_scripts():
    @torch.jit.script
    def f() -> str:
        return torch.ops.ddpx.version()

    assert f() == torch.ops.ddpx.version()


def test_param_ready_is_the_identity_when_nothing_gates():
    """ddpx::param_ready (GradSync's Overlap::NextForward gate) passes a
    tensor through untouched when no GradSync gates it: same tensor, its
    gradient straight to it; opcheck'd for the dispatcher's contracts."""
    w = torch.randn(3, 4, requires_grad=True)
    out = torch.ops.ddpx.param_ready(w)
    assert out is w
    assert torch.ops.ddpx.param_ready_optional(None) is None  # (a conv's bias may be None)
    assert torch.ops.ddpx.param_ready_optional(w) is w
    (torch.ops.ddpx.param_ready(w) * 2).sum().backward()
    assert torch.equal(w.grad, torch.full((3, 4), 2.0))
    torch.library.opcheck(torch.ops.ddpx.param_ready.default, (torch.randn(5),))
    torch.library.opcheck(torch.ops.ddpx.param_ready_optional.default, (torch.randn(5),))

    @torch.jit.script
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ddpx.param_ready(x) + 1

    assert torch.equal(f(torch.zeros(2)), torch.ones(2))
