"""ddpx::compressed_allreduce from Python under mpirun (2 and 3 ranks): eager
against torch.distributed, TorchScript against eager, byte counts, keyed state,
errors, Meta and opcheck. The group is the ddpx_mpi world (group "") or the
torch.distributed group registered under its name."""
import pytest
import torch
import torch.distributed as dist

CODECS = ["none", "fp16", "bf16", "int8", "topk:0.25", "powersgd:2"]


@pytest.fixture(scope="module", autouse=True)
def world():
    if not dist.is_initialized():
        dist.init_process_group("ddpx_mpi")
    yield
    # Leave the group up: other modules of the same process may use it.


def rank_input(shape, seed):
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    return torch.randn(shape, generator=g)


def test_none_equals_torch_distributed_allreduce():
    for shape in [(1,), (17,), (97,), (5, 7), (0,)]:
        x = rank_input(shape, 1)
        ref = x.clone()
        dist.all_reduce(ref)
        got = torch.ops.ddpx.compressed_allreduce(x)
        assert torch.equal(got, ref / dist.get_world_size()), shape
    x = rank_input((4, 6), 2)
    before = x.clone()
    torch.ops.ddpx.compressed_allreduce(x, "fp16")
    assert torch.equal(x, before), "input must not be modified"


@pytest.mark.parametrize("codec", CODECS)
def test_registered_group_name_equals_world(codec):
    x = rank_input((10, 8), 3)
    name = dist.group.WORLD.group_name
    a = torch.ops.ddpx.compressed_allreduce(x, codec, "", name)
    b = torch.ops.ddpx.compressed_allreduce(x, codec)
    assert torch.equal(a, b)


@pytest.mark.parametrize("codec", CODECS)
def test_scripted_equals_eager(codec):
    @torch.jit.script
    def f(x: torch.Tensor, codec: str, key: str) -> torch.Tensor:
        return torch.ops.ddpx.compressed_allreduce(x, codec=codec, key=key)

    x = rank_input((12, 9), 4)
    assert torch.equal(f(x, codec, ""), torch.ops.ddpx.compressed_allreduce(x, codec, ""))
    # Keyed state is the same object whichever way the op is called.
    torch.ops.ddpx.codec_reset(codec, "py")
    a1 = f(x, codec, "py")
    a2 = f(x, codec, "py")
    torch.ops.ddpx.codec_reset(codec, "py")
    assert torch.equal(torch.ops.ddpx.compressed_allreduce(x, codec, "py"), a1)
    assert torch.equal(torch.ops.ddpx.compressed_allreduce(x, codec, "py"), a2)


def test_codec_stats_measure_the_compression():
    x = rank_input((256, 64), 5)
    expected_ratio = {"none": 1.0, "fp16": 2.0, "int8": 3.9, "topk:0.01": 45.0, "powersgd:4": 12.0}
    for codec, at_least in expected_ratio.items():
        calls0, sent0, raw0 = torch.ops.ddpx.codec_stats(codec)
        torch.ops.ddpx.compressed_allreduce(x, codec)
        calls, sent, raw = torch.ops.ddpx.codec_stats(codec)
        assert calls - calls0 == 1
        assert raw - raw0 == 4 * x.numel()
        ratio = (raw - raw0) / (sent - sent0)
        assert at_least * 0.98 <= ratio, (codec, ratio)
    assert torch.ops.ddpx.codec_stats("topk:0.5", "never-used") == [0, 0, 0]


def test_half_input_keeps_its_dtype():
    x = rank_input((33,), 6).half()
    for codec in CODECS:
        y = torch.ops.ddpx.compressed_allreduce(x, codec)
        assert y.dtype == torch.half and y.shape == x.shape


def test_bad_codec_lists_valid_codecs():
    with pytest.raises(RuntimeError, match="valid codecs:"):
        torch.ops.ddpx.compressed_allreduce(torch.ones(3), "gzip")
    with pytest.raises(RuntimeError, match="topk's <ratio> must be in"):
        torch.ops.ddpx.compressed_allreduce(torch.ones(3), "topk:2")
    with pytest.raises(RuntimeError, match="valid codecs:"):
        torch.ops.ddpx.codec_stats("powersgd")


def test_unsupported_dtype_is_rejected():
    with pytest.raises(RuntimeError, match="must be float32, float64, float16 or bfloat16, got Int"):
        torch.ops.ddpx.compressed_allreduce(torch.ones(3, dtype=torch.int32), "int8")


def test_unregistered_group_is_rejected():
    with pytest.raises(RuntimeError, match="is not a registered process group"):
        torch.ops.ddpx.compressed_allreduce(torch.ones(3), "none", "", "nope")


def test_mismatched_shapes_raise_on_every_rank():
    n = 5 if dist.get_rank() == 0 else 6
    with pytest.raises(RuntimeError, match="ranks disagree on the numel"):
        torch.ops.ddpx.compressed_allreduce(torch.ones(n), "fp16")
    assert torch.equal(torch.ops.ddpx.compressed_allreduce(torch.ones(4)), torch.ones(4))


def test_meta_kernel():
    y = torch.ops.ddpx.compressed_allreduce(torch.empty(3, 4, device="meta"), "int8", "k")
    assert y.device.type == "meta" and y.shape == (3, 4) and y.dtype == torch.float32
    with pytest.raises(RuntimeError, match="valid codecs:"):
        torch.ops.ddpx.compressed_allreduce(torch.empty(3, device="meta"), "bogus")


def test_opcheck():
    x = rank_input((6, 5), 7)
    torch.library.opcheck(torch.ops.ddpx.compressed_allreduce.default, (x,), {"codec": "none"},
                          test_utils=("test_schema", "test_faketensor"))
