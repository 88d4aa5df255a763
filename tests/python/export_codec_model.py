"""Scripts a small model that calls ddpx::compressed_allreduce and saves it,
for tests/cpp/codec_jit_test.cpp (a C++ program that torch::jit::load's it).

    python export_codec_model.py OUT.pt
"""
import os
import sys

import torch


class CodecModel(torch.nn.Module):
    """y = mean over ranks of (2 x + 1), through the given codec."""

    def forward(self, x: torch.Tensor, codec: str, key: str) -> torch.Tensor:
        return torch.ops.ddpx.compressed_allreduce(2.0 * x + 1.0, codec, key)


def main():
    torch.ops.load_library(os.environ["DDPX_LIB"])
    torch.jit.script(CodecModel()).save(sys.argv[1])


if __name__ == "__main__":
    main()
