"""Hierarchical attention network for document classification (Yang et al.,
2016): word embedding -> bidirectional word GRU -> word attention gives one
vector per sentence -> bidirectional sentence GRU -> sentence attention gives
the document vector -> linear classifier. The GRUs run on ddpx::fused_gru
(aten=True: torch.gru, what nn.GRU calls).

Input: token ids int64 [N, S, W] (S sentences of W words), 0 = padding. Any S
and W work; the `sentences` and `words` attributes are the sizes the model was
exported for, which ddpx-train feeds. The GRUs also step over padding (fused_gru
has no packed sequences); attention ignores padded words and empty sentences,
and a sentence with no word pools to zeros.
"""
import torch
from torch import nn

from ddpx_layers import Attention, check_tokens, gru, token_contract


class HAN(nn.Module):
    def __init__(self, vocab_size: int = 2000, sentences: int = 8, words: int = 12,
                 embed: int = 64, hidden: int = 64, num_classes: int = 4, aten: bool = False):
        super().__init__()
        token_contract(self, vocab_size, sentences, words, num_classes, aten)
        self.embedding = nn.Embedding(vocab_size, embed, padding_idx=0)
        self.word_gru = gru(embed, hidden, bidirectional=True, aten=aten)
        self.word_attention = Attention(2 * hidden)
        self.sentence_gru = gru(2 * hidden, hidden, bidirectional=True, aten=aten)
        self.sentence_attention = Attention(2 * hidden)
        self.classifier = nn.Linear(2 * hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, S, W] int64 -> [N, num_classes]
        check_tokens(x, self.vocab_size)
        n, s, w = x.size(0), x.size(1), x.size(2)
        words = x.reshape(n * s, w)
        word_mask = words != 0                                   # [N*S, W]
        h, _ = self.word_gru(self.embedding(words))              # [N*S, W, 2H]
        sent = self.word_attention(h, word_mask).reshape(n, s, -1)  # [N, S, 2H]
        sent_mask = word_mask.reshape(n, s, w).any(dim=2)        # [N, S]
        hs, _ = self.sentence_gru(sent)                          # [N, S, 2H]
        return self.classifier(self.sentence_attention(hs, sent_mask))
