"""Layers shared by the scripted models: a 2-D convolution and a GRU that run
on the ddpx ops (torch.ops.ddpx.tiled_conv2d / fused_gru) or, with aten=True,
on the ATen ops they replace, with the same parameters either way.

`aten` is a Final (TorchScript constant), so `if self.aten:` is resolved when
the module is scripted: the saved model holds only the chosen branch, and an
aten=True model scripts and loads without the plugin.
"""
import math
from typing import Final, List, Tuple

import torch
from torch import nn


def check_image(x: torch.Tensor):
    """The image contract of lenet and mlp: float32 [N, 1, 28, 28]."""
    if x.dim() != 4 or x.size(1) != 1 or x.size(2) != 28 or x.size(3) != 28:
        raise ValueError("x must be [N, 1, 28, 28] images, got shape {}".format(x.shape))
    if x.dtype != torch.float32:
        raise ValueError("x must be float32, got {}".format(x.dtype))


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


class Conv2d(nn.Module):
    """F.conv2d with nn.Conv2d's parameters (weight [C_out, C_in, k, k], bias
    [C_out]) and its default initialisation."""

    aten: Final[bool]

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, padding: int = 0,
                 aten: bool = False):
        super().__init__()
        self.aten = aten
        self.padding: List[int] = [padding, padding]
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size,
                                               kernel_size))
        self.bias = nn.Parameter(torch.empty(out_channels))
        # nn.Conv2d's default: kaiming_uniform(a=sqrt(5)) is U(-1/sqrt(fan_in), +).
        bound = 1.0 / math.sqrt(in_channels * kernel_size * kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C_in, H, W] -> [N, C_out, H', W']
        if self.aten:
            return torch.conv2d(x, self.weight, self.bias, [1, 1], self.padding, [1, 1], 1)
        return torch.ops.ddpx.tiled_conv2d(x, self.weight, self.bias, [1, 1], self.padding,
                                           [1, 1], 1)


class GRU(nn.Module):
    """One batch-first GRU layer, optionally bidirectional, with nn.GRU's
    parameter names, shapes (gate order r, z, n) and initialisation, so an
    nn.GRU's state_dict loads into it.

    The parameter list is built from the attributes on every call rather than
    kept as a list attribute: a C++ program that moves or replaces the
    parameters (module.to(device)) would leave such a list stale.
    """

    aten: Final[bool]
    bidirectional: Final[bool]
    hidden_size: Final[int]

    def __init__(self, input_size: int, hidden_size: int, bidirectional: bool,
                 aten: bool = False):
        super().__init__()
        self.aten = aten
        self.bidirectional = bidirectional
        self.hidden_size = hidden_size
        bound = 1.0 / math.sqrt(hidden_size)

        def param(*shape):
            return nn.Parameter(torch.empty(*shape).uniform_(-bound, bound))

        self.weight_ih_l0 = param(3 * hidden_size, input_size)
        self.weight_hh_l0 = param(3 * hidden_size, hidden_size)
        self.bias_ih_l0 = param(3 * hidden_size)
        self.bias_hh_l0 = param(3 * hidden_size)
        if bidirectional:
            self.weight_ih_l0_reverse = param(3 * hidden_size, input_size)
            self.weight_hh_l0_reverse = param(3 * hidden_size, hidden_size)
            self.bias_ih_l0_reverse = param(3 * hidden_size)
            self.bias_hh_l0_reverse = param(3 * hidden_size)

    def _flat_weights(self) -> List[torch.Tensor]:
        """nn.GRU's _flat_weights order: per direction w_ih, w_hh, b_ih, b_hh."""
        params = [self.weight_ih_l0, self.weight_hh_l0, self.bias_ih_l0, self.bias_hh_l0]
        if self.bidirectional:
            params.extend([self.weight_ih_l0_reverse, self.weight_hh_l0_reverse,
                           self.bias_ih_l0_reverse, self.bias_hh_l0_reverse])
        return params

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        # x [B, T, I] -> (output [B, T, D*H], h_n [D, B, H]), D = 2 if bidirectional.
        params = self._flat_weights()
        if self.aten:
            directions = 2 if self.bidirectional else 1
            h0 = torch.zeros(directions, x.size(0), self.hidden_size, dtype=x.dtype,
                             device=x.device)
            return torch.gru(x, h0, params, True, 1, 0.0, self.training, self.bidirectional,
                             True)
        return torch.ops.ddpx.fused_gru(x, None, params, True, 1, 0.0, self.training,
                                        self.bidirectional, True)


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
        # Where a row has a valid step, exp(-1e9 - max) is exactly 0.
        alpha = torch.softmax(scores.masked_fill(~mask, -1e9), dim=1) * mask.to(h.dtype)
        return torch.bmm(alpha.unsqueeze(1), h).squeeze(1)
