"""The pip package's CUDA build, checked on the lent GPU (check.sh's `pip`
group): run from outside the checkout with only the installed wheel on the
path. `import ddpx` must load the package's own libddpx.so and the CUDA
kernels beside it, and the ops must give on CUDA tensors what they give on
the CPU. Exits non-zero on the first difference."""
import sys
from pathlib import Path

import torch

import ddpx
from ddpx import ops

lib = Path(ddpx.library_path())
print(f"ddpx {ddpx.__version__} built against torch {ddpx._loader.built_against()}, "
      f"loaded {lib}")
assert lib.parent == Path(ddpx.__file__).resolve().parent / "lib", \
    f"{lib} is not the installed package's library"
assert (lib.parent / "libddpx_cuda.so").exists(), f"no libddpx_cuda.so beside {lib}"
assert torch.cuda.is_available(), "no CUDA device"

g = torch.Generator().manual_seed(0)
x = torch.randn(3, 4, 29, 31, generator=g, dtype=torch.double)
w = torch.randn(6, 2, 3, 5, generator=g, dtype=torch.double)
b = torch.randn(6, generator=g, dtype=torch.double)
want = ops.tiled_conv2d(x, w, b, stride=(2, 1), padding=(1, 2), groups=2)
got = ops.tiled_conv2d(x.cuda(), w.cuda(), b.cuda(), stride=(2, 1), padding=(1, 2), groups=2)
torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-10)
print("tiled_conv2d: CUDA equals the CPU (double)")

gru = torch.nn.GRU(7, 16, num_layers=2, bidirectional=True, dtype=torch.double)
seq = torch.randn(11, 5, 7, generator=g, dtype=torch.double)
out_cpu, h_cpu = ops.fused_gru(seq, None, gru._flat_weights, num_layers=2, bidirectional=True)
gru = gru.cuda()
out_gpu, h_gpu = ops.fused_gru(seq.cuda(), None, gru._flat_weights, num_layers=2,
                               bidirectional=True)
torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-9, atol=1e-9)
torch.testing.assert_close(h_gpu.cpu(), h_cpu, rtol=1e-9, atol=1e-9)
print("fused_gru: CUDA equals the CPU (double)")

v = torch.randn(1000, generator=g)
packed_cpu = torch.ops.ddpx._int8_pack(v, 64)
packed_gpu = torch.ops.ddpx._int8_pack(v.cuda(), 64)
assert torch.equal(packed_gpu.cpu().view(torch.uint8), packed_cpu.view(torch.uint8)), "int8 pack"
print("int8 codec: CUDA pack equals the CPU bit for bit")

torch.backends.cudnn.allow_tf32 = False  # (the reference in float32; our kernels may serve)
m = ddpx.nn.TiledConv2d(3, 8, 3, padding="same").cuda()
ref = torch.nn.functional.conv2d(torch.ones(2, 3, 9, 9, device="cuda"), m.weight, m.bias,
                                 padding=1)
torch.testing.assert_close(m(torch.ones(2, 3, 9, 9, device="cuda")), ref, rtol=1e-4, atol=1e-4)
print("ddpx.nn.TiledConv2d on CUDA matches F.conv2d")
sys.exit(0)
