"""A pre-LayerNorm transformer encoder for document classification whose
blocks a layer-drop pattern can skip (LayerDrop, stochastic depth,
Progressive Layer Dropping; ddpx-train --layer-drop).

Input: token ids int64 [N, S, W] (the generated documents HAN reads), taken as
one sequence of S*W tokens, 0 = padding: token + position embedding -> `depth`
blocks of [x + s * attention(LN(x)); x + s * MLP(LN(x))] -> LayerNorm -> mean
over the non-padded tokens -> linear classifier. Padded tokens are never
attended to; a document with no token attends to all (it stays finite).

`block_scale` (one float per block) is the drop pattern, set by the trainer
before each forward: 0 skips block i outright (its parameters get no
gradient, so nothing of it needs to be computed or reduced), s > 0 scales its
two residual branches by s -- 1/keep-probability while training under a drop
schedule, so a block's expected contribution is the one evaluation sees with
every block at 1 (timm's DropPath convention; fairseq's LayerDrop does not
rescale: set s = 1). Every block at 1 (the default) is the plain encoder.
Parameters of block i are named "blocks.<i>.*": the drop units GradSync is
told about. The defaults keep what no pattern drops small (a 500-word
vocabulary: the embedding is 5% of the bytes, the blocks 94%), so dropping a
block saves nearly its share of the wire.
"""
import math
from typing import List

import torch
from torch import nn
from torch.nn import functional as F

from ddpx_layers import check_tokens, token_contract


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"dim={dim} must be a multiple of heads={heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, attend: torch.Tensor, scale: float) -> torch.Tensor:
        # x [N, T, D]; attend [N, 1, 1, T] bool, True = a key to attend to.
        n, t, d = x.size(0), x.size(1), x.size(2)
        qkv = self.qkv(self.ln1(x)).reshape(n, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [N, heads, T, D/heads]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attend)
        x = x + scale * self.proj(a.transpose(1, 2).reshape(n, t, d))
        return x + scale * self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab_size: int = 500, sentences: int = 6, words: int = 8,
                 dim: int = 128, depth: int = 6, heads: int = 4, num_classes: int = 4,
                 aten: bool = False):
        super().__init__()
        # (No ddpx op here: the --aten export is the same model.)
        token_contract(self, vocab_size, sentences, words, num_classes, aten)
        self.depth = depth
        self.block_scale: List[float] = [1.0] * depth
        self.embedding = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.position = nn.Parameter(torch.randn(sentences * words, dim) / math.sqrt(dim))
        self.blocks = nn.ModuleList([Block(dim, heads, 4 * dim) for _ in range(depth)])
        self.ln = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, S, W] int64 -> [N, num_classes]
        check_tokens(x, self.vocab_size)
        if x.size(1) * x.size(2) > self.position.size(0):
            raise ValueError("x has {} tokens per document; the model holds positions for {}"
                             .format(x.size(1) * x.size(2), self.position.size(0)))
        if len(self.block_scale) != len(self.blocks):
            raise ValueError("block_scale has {} entries for {} blocks".format(
                len(self.block_scale), len(self.blocks)))
        n = x.size(0)
        tokens = x.reshape(n, x.size(1) * x.size(2))  # [N, T]
        t = tokens.size(1)
        valid = tokens != 0
        # A document of padding alone attends to all of it (finite, ignored).
        attend = valid | ~valid.any(dim=1, keepdim=True)
        h = self.embedding(tokens) + self.position[:t]
        mask = attend.reshape(n, 1, 1, t)
        for i, block in enumerate(self.blocks):
            s = self.block_scale[i]
            if s != 0.0:
                h = block(h, mask, s)
        h = self.ln(h)
        w = valid.to(h.dtype).unsqueeze(2)  # mean over the real tokens
        pooled = (h * w).sum(dim=1) / w.sum(dim=1).clamp(min=1.0)
        return self.classifier(pooled)
