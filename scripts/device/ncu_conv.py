"""The workload Nsight Compute profiles in the device check (its `ncu conv`
step): ddpx::tiled_conv2d forward + backward through our small-filter kernels
(DDPX_CONV_PATH=tiled) on the seed's 3x3 2048x2048 image, a channels_last
depthwise 7x7 (ConvNeXt-T's first stage) and an NCHW depthwise 3x3 (the
bench's "depthwise 3x3 c64", 1.25-1.43x the peer on the H200, 2026-11-30),
float32, one call each after a
warm-up; ncu (--profile-from-start off) profiles the second call of each
case, between cudaProfilerStart and Stop, and picks the kernels by name
(small_*, nhwc_*, sum_partials)."""
import os

import torch

os.environ["DDPX_CONV_PATH"] = "tiled"
torch.ops.load_library(os.environ["DDPX_LIB"])
op = torch.ops.ddpx.tiled_conv2d
CASES = (  # (n, c, hw, k, stride, groups, channels_last)
    (1, 1, 2048, 3, 1, 1, False),
    (8, 96, 56, 7, 1, 96, True),
    (8, 64, 56, 3, 1, 64, False),
)
for n, c, hw, k, s, g, cl in CASES:
    torch.manual_seed(0)
    x = torch.randn(n, c, hw, hw, device="cuda")
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    w = torch.randn(c, c // g, k, k, device="cuda", requires_grad=True)
    for it in range(2):
        if it == 1:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        y = op(x, w, None, [s, s], [k // 2, k // 2], [1, 1], g)
        torch.autograd.grad(y, (x, w), torch.ones_like(y))
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"n{n} c{c} {hw}x{hw} k{k} s{s} g{g}{' cl' if cl else ''}:",
          torch.ops.ddpx.tiled_conv2d_path(x, w, [s, s], [k // 2, k // 2], [1, 1], g))
