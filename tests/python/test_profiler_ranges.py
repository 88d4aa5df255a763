"""The ddpx ranges in torch.profiler from Python (under mpirun, 2 and 3
ranks): a codec call shows its shape agreement and its payload collective as
"ddpx::codec_agreement" / "ddpx::codec_wire" inside the op's own range, the
same RecordFunction ranges GradSync's trace splits encode / wire / decode by."""
import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


@pytest.fixture(scope="module", autouse=True)
def world():
    if not dist.is_initialized():
        dist.init_process_group("ddpx_mpi")
    yield


@pytest.mark.parametrize("codec,payload_calls", [("fp16", 1), ("int8", 1), ("powersgd:2", 2)])
def test_codec_phases_are_profiler_ranges(codec, payload_calls):
    x = torch.randn(64, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ops.ddpx.compressed_allreduce(x, codec, "")
    names = [e.name for e in prof.events()]
    assert names.count("ddpx::codec_agreement") == 1, names
    # int8 all-gathers codes and scales; powersgd reduces P and Q.
    assert names.count("ddpx::codec_wire") >= payload_calls, names
    op = next(e for e in prof.events() if e.name == "ddpx::compressed_allreduce")
    for e in prof.events():
        if e.name.startswith("ddpx::codec_"):
            assert op.time_range.start <= e.time_range.start <= e.time_range.end <= op.time_range.end

