"""Writes a torch.save file from Python's own pickler (memoised strings,
shared and empty storages, views, transposes, several dtypes) for
test_archive_check.cpp, which must walk it, understand every tensor in it
and load it with LibTorch.

    python export_torch_save.py OUT.pt
"""
import sys

import torch

x = torch.arange(24, dtype=torch.uint8).view(2, 3, 4)
torch.save({"train_x": x, "view": x[1:, :, 1:3], "t": torch.randn(3, 5).t(),
            "empty": torch.zeros(0, 4), "labels": torch.arange(5),
            "mask": torch.tensor([True, False]), "half": torch.ones(3, dtype=torch.half),
            "big": torch.tensor([2**40])}, sys.argv[1])
