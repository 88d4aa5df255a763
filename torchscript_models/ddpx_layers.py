"""Layers shared by the scripted models: a 2-D convolution and a GRU that run
on the ddpx ops (ddpx.nn.TiledConv2d / FusedGRU) or, with aten=True, are the
torch.nn modules those replace, with the same parameters either way; the
input contracts ddpx-train relies on; HAN's attention pooling.

The choice is made when the model is built, so the saved model holds only
the chosen layer, and an aten=True model builds, scripts and loads without
the plugin.
"""
import math

import torch
from torch import nn


def check_image(x: torch.Tensor):
    """The image contract of lenet and mlp: float32 [N, 1, 28, 28] (bfloat16
    or float16 for a model whose parameters are: ddpx-train --param-dtype)."""
    if x.dim() != 4 or x.size(1) != 1 or x.size(2) != 28 or x.size(3) != 28:
        raise ValueError("x must be [N, 1, 28, 28] images, got shape {}".format(x.shape))
    if x.dtype != torch.float32 and x.dtype != torch.bfloat16 and x.dtype != torch.float16:
        raise ValueError("x must be float32 (or bfloat16, float16), got {}".format(x.dtype))


def token_contract(m: nn.Module, vocab_size: int, sentences: int, words: int, num_classes: int,
                   aten: bool):
    """The attributes ddpx-train reads from a token model (module.attr(name)):
    what it feeds (token ids [N, sentences, words] below vocab_size) and how
    many classes it scores; aten_reference records an --aten export."""
    m.ddpx_input = "tokens"
    m.num_classes = num_classes
    m.vocab_size = vocab_size
    m.sentences = sentences
    m.words = words
    m.aten_reference = aten


def check_tokens(x: torch.Tensor, vocab_size: int):
    """The token contract of han and transformer: int64 ids [N, S, W] in
    [0, vocab_size)."""
    if x.dim() != 3:
        raise ValueError("x must be [N, sentences, words] token ids, got shape {}".format(x.shape))
    if x.dtype != torch.int64:
        raise ValueError("x must be int64 token ids, got {}".format(x.dtype))
    if x.numel() > 0 and (int(x.min()) < 0 or int(x.max()) >= vocab_size):
        raise ValueError("x must hold token ids in [0, vocab_size={}), got [{}, {}]".format(
            vocab_size, int(x.min()), int(x.max())))


def conv2d(in_channels: int, out_channels: int, kernel_size: int, padding: int = 0,
           aten: bool = False) -> nn.Conv2d:
    """A 2-D convolution: ddpx.nn.TiledConv2d (on ddpx::tiled_conv2d) or, with
    aten=True, torch.nn.Conv2d itself. Same parameters and initialisation
    either way (TiledConv2d is an nn.Conv2d)."""
    if aten:
        return nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding)
    import ddpx.nn  # only here: an aten=True export must not need the plugin
    return ddpx.nn.TiledConv2d(in_channels, out_channels, kernel_size, padding=padding)


def gru(input_size: int, hidden_size: int, bidirectional: bool, aten: bool = False) -> nn.GRU:
    """One batch-first GRU layer: ddpx.nn.FusedGRU (on ddpx::fused_gru) or,
    with aten=True, torch.nn.GRU itself. Same parameters and initialisation
    either way (FusedGRU is an nn.GRU)."""
    if aten:
        return nn.GRU(input_size, hidden_size, batch_first=True, bidirectional=bidirectional)
    import ddpx.nn  # only here: an aten=True export must not need the plugin
    return ddpx.nn.FusedGRU(input_size, hidden_size, batch_first=True,
                            bidirectional=bidirectional)


class Attention(nn.Module):
    """Attention pooling of HAN (Yang et al., 2016, eq. 5-7 and 8-10):
    u_t = tanh(W h_t + b), a_t = softmax_t(u_t . c) over the valid steps,
    result sum_t a_t h_t. A row with no valid step pools to zeros."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.context = nn.Parameter(torch.empty(dim).uniform_(-1.0 / math.sqrt(dim),
                                                              1.0 / math.sqrt(dim)))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # h [B, T, D], mask [B, T] bool (True = a real step) -> [B, D]
        scores = torch.matmul(torch.tanh(self.proj(h)), self.context)  # [B, T]
        # A finite fill, not -inf: a row with no valid step must not give NaN.
        # Where a row has a valid step, exp(-1e9 - max) is exactly 0. In
        # float32 (a no-op for float32 models): -1e9 is no float16 (autocast
        # to float16 made scores float16), and the softmax is steadier so.
        alpha = torch.softmax(scores.float().masked_fill(~mask, -1e9), dim=1) * mask.float()
        return torch.bmm(alpha.to(h.dtype).unsqueeze(1), h).squeeze(1)
