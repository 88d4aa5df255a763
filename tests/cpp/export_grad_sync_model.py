"""Scripts a small double-precision model for test_grad_sync_jit.cpp, which
wraps the loaded module in ddpx::GradSync (the torch::jit::Module
constructor). forward(x, step) returns the loss; head `d` is used on odd
steps only and head `c` on even steps (unused parameters), `f` is frozen
(requires_grad False: verified and broadcast all the same), `scale` is a
buffer (broadcast from rank 0 at construction), and `e` is an embedding with
sparse gradients (rows picked from x), which GradSync finds in the scripted
module as DDP finds nn.Embedding(sparse=True).

    python export_grad_sync_model.py OUT.pt
"""
import sys

import torch
from torch import Tensor, nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.f = nn.Linear(16, 16).requires_grad_(False)
        self.c = nn.Linear(16, 3)
        self.d = nn.Linear(16, 3)
        self.e = nn.Embedding(20, 16, sparse=True)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, x: Tensor, step: int) -> Tensor:
        rows = (x[:, :2].abs() * 10).long().remainder(20)
        h = torch.relu(self.f(torch.relu(self.a(x))))
        h = torch.tanh(self.b(h) + self.e(rows).sum(1)) * self.scale
        out = self.c(h) if step % 2 == 0 else self.d(h)
        return out.pow(2).mean()


def main():
    torch.manual_seed(0)
    torch.jit.script(Net().double()).save(sys.argv[1])


if __name__ == "__main__":
    main()
