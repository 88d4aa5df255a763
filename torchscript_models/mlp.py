"""A multilayer perceptron for 28x28 single-channel images: 784->512->256->10
with ReLU. No ddpx op inside (Linear layers only); its ~0.5 M parameters in
few large tensors make it the communication-heavy model of the three."""
from typing import List

import torch
from torch import nn

from ddpx_layers import check_image


class MLP(nn.Module):
    def __init__(self, num_classes: int = 10, hidden: int = 512, aten: bool = False):
        super().__init__()
        # Read by ddpx-train through module.attr(name).
        self.ddpx_input = "image"
        self.num_classes = num_classes
        self.image_shape: List[int] = [1, 28, 28]  # [C, H, W] of one sample
        self.aten_reference = aten  # exported with --aten
        self.fc1 = nn.Linear(28 * 28, hidden)
        self.fc2 = nn.Linear(hidden, hidden // 2)
        self.fc3 = nn.Linear(hidden // 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 1, 28, 28] -> [N, num_classes]
        check_image(x)
        x = torch.relu(self.fc1(x.flatten(1)))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)
