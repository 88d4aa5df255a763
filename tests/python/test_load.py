import torch


def test_version_op_is_registered():
    v = torch.ops.ddpx.version()
    assert isinstance(v, str) and v.count(".") == 2


def test_version_op_scripts():
    @torch.jit.script
    def f() -> str:
        return torch.ops.ddpx.version()

    assert f() == torch.ops.ddpx.version()
