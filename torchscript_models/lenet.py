"""LeNet-5 for 28x28 single-channel images (LeCun et al., 1998, with ReLU and
max pooling): conv 5x5 (pad 2) 1->6, pool, conv 5x5 6->16, pool, then fully
connected 400->120->84->10. The convolutions run on ddpx::tiled_conv2d
(aten=True: F.conv2d)."""
from typing import List

import torch
from torch import nn

from ddpx_layers import check_image, conv2d


class LeNet(nn.Module):
    def __init__(self, num_classes: int = 10, aten: bool = False):
        super().__init__()
        # Read by ddpx-train through module.attr(name).
        self.ddpx_input = "image"
        self.num_classes = num_classes
        self.image_shape: List[int] = [1, 28, 28]  # [C, H, W] of one sample
        self.aten_reference = aten  # exported with --aten
        self.conv1 = conv2d(1, 6, 5, padding=2, aten=aten)
        self.conv2 = conv2d(6, 16, 5, aten=aten)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 1, 28, 28] -> [N, num_classes]
        check_image(x)
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)  # [N, 6, 14, 14]
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)  # [N, 16, 5, 5]
        x = torch.relu(self.fc1(x.flatten(1)))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)
