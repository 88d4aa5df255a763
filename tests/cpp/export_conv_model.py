"""Scripts a small LeNet-like model that calls ddpx::tiled_conv2d and saves it,
with an example input, its output and one gradient as attributes, for
test_jit_conv.cpp (which loads it with torch::jit::load and must match).

    python export_conv_model.py OUT.pt      (DDPX_LIB names the plugin)
"""
import os
import sys

import torch


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(6, 1, 5, 5, generator=g) * 0.2)
        self.b1 = torch.nn.Parameter(torch.randn(6, generator=g) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(16, 6, 5, 5, generator=g) * 0.1)
        self.w3 = torch.nn.Parameter(torch.randn(16, 1, 3, 3, generator=g) * 0.3)  # depthwise
        self.example_input = torch.randn(3, 1, 28, 28, generator=g)
        self.expected_output = torch.zeros(0)
        self.expected_grad_w2 = torch.zeros(0)

    def forward(self, x):
        x = torch.relu(torch.ops.ddpx.tiled_conv2d(x, self.w1, self.b1, [1, 1], [2, 2]))
        x = torch.max_pool2d(x, 2)
        x = torch.relu(torch.ops.ddpx.tiled_conv2d(x, self.w2, None, [1, 1], [0, 0], [1, 1], 1))
        return torch.ops.ddpx.tiled_conv2d(x, self.w3, None, [2, 2], [2, 2], [2, 2], 16)


def main():
    torch.ops.load_library(os.environ["DDPX_LIB"])
    net = ConvNet()
    out = net(net.example_input)
    (grad_w2,) = torch.autograd.grad(out.sum(), net.w2)
    net.expected_output = out.detach()
    net.expected_grad_w2 = grad_w2
    torch.jit.script(net).save(sys.argv[1])


if __name__ == "__main__":
    main()
