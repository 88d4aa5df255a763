"""Scripts the model of test_grad_sync_gated.cpp (GradSync's graph pass for
Overlap::NextForward). Its reads of parameters and buffers take every shape
the pass must gate: two instances of one submodule type (one graph, two
sets of parameters), a weight used twice (the embedding, tied to the
output projection), BatchNorm's buffers (read and updated in place), a
convolution's bias (an Optional[Tensor] attribute), a parameter read in a
branch, and an exported method other than forward that
reads parameters (`weight_norm`, which a trainer calls between steps).

    python export_gated_model.py OUT.pt
"""
import sys

import torch
from torch import Tensor, nn


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc(x)) * self.gain
        if bool(h.sum() > 0):
            h = h + self.gain  # the same parameter, read again in a branch
        return x + h


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.b1 = Block(8)
        self.b2 = Block(8)
        self.bn = nn.BatchNorm1d(8)
        self.conv = nn.Conv1d(1, 1, 3, padding=1)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.emb(tokens).mean(1)
        h = self.bn(self.b2(self.b1(h)))
        h = self.conv(h.unsqueeze(1)).squeeze(1)
        logits = h @ self.emb.weight.t()  # tied: the embedding again
        return logits.pow(2).mean()

    @torch.jit.export
    def weight_norm(self) -> Tensor:
        return self.b1.fc.weight.norm() + self.b2.gain.sum()


def main():
    torch.manual_seed(0)
    torch.jit.script(Net().double()).save(sys.argv[1])


if __name__ == "__main__":
    main()
