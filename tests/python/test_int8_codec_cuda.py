"""The int8 codec's CUDA kernels (label gpu) equal the CPU kernels bit for bit:
the packed message (codes, padding, per-chunk scales), the error-feedback
residual, and the decoded sum of several messages; odd, empty and one-element
sizes, chunks from 1 to larger than the input, all-zero chunks, NaN. Then
compressed_allreduce with CUDA tensors at world size 1 (a FileStore group):
the result on the tensor's device, and equal to the same call on the CPU.
"""
import pytest
import torch

from conftest import needs_cuda

pytestmark = needs_cuda
ops = torch.ops.ddpx
SIZES = [0, 1, 3, 4, 255, 256, 1001, 4097, 100003]
CHUNKS = [1, 3, 64, 256, 5000]


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, max(n, 1))[:n]
    if n > 300:
        x[100:300] = 0.0  # whole chunks of zeros (scale 0) for the small chunk sizes
    return x


def _equal_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    ai = a.view(torch.int32) if a.dtype == torch.float32 else a
    bi = b.view(torch.int32) if b.dtype == torch.float32 else b
    diff = (ai.cpu() != bi.cpu()).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.numel()} elements differ, first at {diff[:4].tolist()}"


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("n", SIZES)
def test_pack_equals_cpu(n, chunk):
    x = _data(n, n + chunk)
    _equal_bits(ops._int8_pack(x.cuda(), chunk), ops._int8_pack(x, chunk), "packed")


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("n", SIZES)
def test_pack_ef_equals_cpu(n, chunk):
    x, e = _data(n, n), _data(n, n + 1) * 0.01
    ec = e.cuda()
    packed_cuda = ops._int8_pack_ef(x.cuda(), ec, chunk)
    packed_cpu = ops._int8_pack_ef(x, e, chunk)
    _equal_bits(packed_cuda, packed_cpu, "packed")
    _equal_bits(ec, e, "residual")


@pytest.mark.parametrize("alpha", [1.0, 1 / 3])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("chunk", [1, 64, 5000])
@pytest.mark.parametrize("n", SIZES)
def test_unpack_sum_equals_cpu(n, chunk, rows, alpha):
    packed = torch.stack([ops._int8_pack(_data(n, 7 * r + n), chunk) for r in range(rows)])
    _equal_bits(ops._int8_unpack_sum(packed.cuda(), n, chunk, alpha),
                ops._int8_unpack_sum(packed, n, chunk, alpha), "sum")


PARTS = [[5], [3, 300, 1, 0, 257], [0, 0], [256, 256, 9], [1] * 40, [100003, 4097]]


@pytest.mark.parametrize("chunk", [1, 7, 256])
@pytest.mark.parametrize("parts", PARTS, ids=lambda p: f"{len(p)}parts")
def test_parts_equal_cpu(parts, chunk):
    """Per-part chunks (a GradSync bucket's tensors, issue 47): the CUDA
    kernels' chunk-bounds table gives the CPU kernels' message, residual and
    sum bit for bit."""
    n = sum(parts)
    x, e = _data(n, n + chunk), _data(n, n + 2) * 0.01
    ec = e.cuda()
    packed_cuda = ops._int8_pack_ef(x.cuda(), ec, chunk, parts)
    packed_cpu = ops._int8_pack_ef(x, e, chunk, parts)
    _equal_bits(packed_cuda, packed_cpu, "packed")
    _equal_bits(ec, e, "residual")
    rows = torch.stack([packed_cpu, ops._int8_pack(_data(n, 5), chunk, parts)])
    _equal_bits(ops._int8_unpack_sum(rows.cuda(), n, chunk, 0.5, parts),
                ops._int8_unpack_sum(rows, n, chunk, 0.5, parts), "sum")


@pytest.mark.sanitizer
def test_kernels_on_a_few_shapes():
    """The few launches compute-sanitizer runs (scripts/device/check.sh): every
    kernel, odd and empty sizes, chunks smaller and larger than the input."""
    for n in (0, 1, 1001, 4097):
        for chunk in (1, 64, 5000):
            x, e = _data(n, n), _data(n, 1) * 0.01
            ec = e.cuda()
            _equal_bits(ops._int8_pack_ef(x.cuda(), ec, chunk), ops._int8_pack_ef(x, e, chunk), "ef")
            packed = torch.stack([ops._int8_pack(_data(n, r), chunk) for r in range(3)])
            _equal_bits(ops._int8_unpack_sum(packed.cuda(), n, chunk, 0.5),
                        ops._int8_unpack_sum(packed, n, chunk, 0.5), "sum")
    parts = [3, 0, 1001, 64]
    x, e = _data(1068, 3), _data(1068, 4) * 0.01
    ec = e.cuda()
    msg = ops._int8_pack_ef(x.cuda(), ec, 64, parts)
    _equal_bits(msg, ops._int8_pack_ef(x, e, 64, parts), "parts ef")
    _equal_bits(ops._int8_unpack_sum(msg[None], 1068, 64, 1.0, parts),
                ops._int8_unpack_sum(msg.cpu()[None], 1068, 64, 1.0, parts), "parts sum")


def test_nan_reaches_the_result_on_cuda():
    x = torch.ones(10)
    x[3] = float("nan")
    y = ops._int8_unpack_sum(ops._int8_pack(x.cuda(), 4)[None], 10, 4)
    assert torch.isnan(y[:4]).all() and not torch.isnan(y[4:]).any()


def test_bad_arguments_are_named_on_cuda():
    with pytest.raises(RuntimeError, match="input must be a 1-D contiguous CUDA"):
        ops._int8_pack(torch.ones(4, 4, device="cuda"), 4)
    with pytest.raises(RuntimeError, match="residual must have input's 8 elements"):
        ops._int8_pack_ef(torch.ones(8, device="cuda"), torch.ones(7, device="cuda"), 4)


@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


@pytest.mark.parametrize("codec", ["int8", "none"])
def test_compressed_allreduce_with_cuda_tensors(world_of_one, codec):
    x = _data(4097, 5)
    got = ops.compressed_allreduce(x.cuda(), codec, "cuda", world_of_one)
    ref = ops.compressed_allreduce(x.clone(), codec, "cpu", world_of_one)
    assert got.device.type == "cuda"
    _equal_bits(got, ref, f"compressed_allreduce({codec})")
