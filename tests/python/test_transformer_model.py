"""torchscript_models/transformer.py, the model layer dropping drops from
(issue 25): scripted equals eager, forward and gradients, with and without
dropped blocks; a block's scale and a dropped block mean what the docstring
says (checked against the layers composed by hand); gradcheck in double;
padding, and the errors for bad input.

Tolerances (float32): scripted and eager run the same kernels: 1e-5 / 1e-6.
"""
import os
import sys

import pytest
import torch
from torch.nn import functional as F
from torch.testing import assert_close

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.append(os.path.join(ROOT, "scripts"))
import export_models  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script
torch.set_num_threads(1)

TOL = dict(rtol=1e-5, atol=1e-6)
PATTERNS = [[1.0] * 6, [2.0, 0.0, 1.25, 0.0, 0.0, 1.0], [0.0] * 6, [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]]


def documents(n, seed=0, vocab=500, s=6, w=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, vocab, (n, s, w), generator=g)
    if n > 1:
        x[1, :, 5:] = 0  # a padded tail
    return x


@pytest.fixture(scope="module")
def pair():
    eager = export_models.build("transformer", seed=5)
    scripted = export_models.script(export_models.build("transformer", seed=5))
    return eager, scripted


@pytest.mark.parametrize("scales", PATTERNS, ids=["all", "mixed", "none", "last-dropped"])
@pytest.mark.parametrize("n", [1, 3])
def test_scripted_equals_eager_forward_and_gradients(pair, scales, n):
    eager, scripted = pair
    x = documents(n, seed=n)
    eager.block_scale = list(scales)
    scripted.block_scale = list(scales)
    out_e, out_s = eager(x), scripted(x)
    assert_close(out_s, out_e, **TOL)
    eager.zero_grad(set_to_none=True)
    scripted.zero_grad(set_to_none=True)
    (out_e * torch.arange(1.0, out_e.numel() + 1).view_as(out_e)).sum().backward()
    (out_s * torch.arange(1.0, out_s.numel() + 1).view_as(out_s)).sum().backward()
    for (name, pe), (_, ps) in zip(eager.named_parameters(), scripted.named_parameters()):
        dropped = name.startswith("blocks.") and scales[int(name.split(".")[1])] == 0
        if dropped:  # skipped outright: no gradient at all, as GradSync is told
            assert pe.grad is None and ps.grad is None, name
        else:
            assert_close(ps.grad, pe.grad, **TOL, msg=name)


def by_hand(m, x, scales):
    """The model's documented computation, from its layers."""
    n = x.size(0)
    tokens = x.reshape(n, -1)
    valid = tokens != 0
    attend = (valid | ~valid.any(1, keepdim=True)).reshape(n, 1, 1, -1)
    h = m.embedding(tokens) + m.position[: tokens.size(1)]
    for blk, s in zip(m.blocks, scales):
        if s == 0:
            continue
        d = h.size(2)
        q, k, v = blk.qkv(blk.ln1(h)).split(d, dim=2)
        heads = lambda t: t.reshape(n, -1, blk.heads, d // blk.heads).transpose(1, 2)  # noqa: E731
        scores = heads(q) @ heads(k).transpose(2, 3) / (d // blk.heads) ** 0.5
        scores = scores.masked_fill(~attend, float("-inf"))
        a = (scores.softmax(-1) @ heads(v)).transpose(1, 2).reshape(n, -1, d)
        h = h + s * blk.proj(a)
        h = h + s * blk.fc2(F.gelu(blk.fc1(blk.ln2(h))))
    h = m.ln(h)
    w = valid.float().unsqueeze(2)
    return m.classifier((h * w).sum(1) / w.sum(1).clamp(min=1))


@pytest.mark.parametrize("scales", PATTERNS[:3], ids=["all", "mixed", "none"])
def test_forward_is_the_documented_residual_network(pair, scales):
    eager, _ = pair
    eager.block_scale = list(scales)
    x = documents(3, seed=9)
    with torch.no_grad():
        assert_close(eager(x), by_hand(eager, x, scales), rtol=1e-4, atol=1e-5)


def test_gradcheck_double_with_a_dropped_block():
    from transformer import Transformer  # scripts/export_models.py put its directory on the path
    torch.manual_seed(0)
    m = Transformer(vocab_size=20, sentences=2, words=3, dim=8, depth=3, heads=2).double()
    m.block_scale = [1.5, 0.0, 1.0]
    x = torch.randint(1, 20, (2, 2, 3))
    x[0, 1, 1:] = 0
    names = [n for n, _ in m.named_parameters() if not n.startswith("blocks.1.")]
    params = dict(m.named_parameters())

    def f(*values):
        return torch.func.functional_call(m, dict(zip(names, values)), (x,))

    inputs = tuple(params[n].detach().clone().requires_grad_() for n in names)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-5)


def test_a_document_of_padding_alone_is_finite(pair):
    eager, scripted = pair
    scripted.block_scale = [1.0] * 6
    x = documents(3)
    x[0] = 0
    out = scripted(x)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in scripted.parameters() if p.grad is not None)


def test_empty_batch(pair):
    _, scripted = pair
    scripted.block_scale = [1.0] * 6
    assert scripted(torch.zeros(0, 6, 8, dtype=torch.int64)).shape == (0, 4)


@pytest.mark.parametrize("x,scales,message", [
    (torch.ones(2, 48, dtype=torch.int64), None, r"x must be \[N, sentences, words\]"),
    (torch.ones(2, 6, 8, dtype=torch.int32), None, "x must be int64"),
    (torch.full((2, 6, 8), 500), None, "vocab_size=500"),
    (torch.ones(2, 7, 8, dtype=torch.int64), None, "positions for 48"),
    (torch.ones(2, 6, 8, dtype=torch.int64), [1.0] * 5, "block_scale has 5 entries for 6 blocks"),
])
def test_bad_input_is_named(pair, x, scales, message):
    _, scripted = pair
    scripted.block_scale = scales or [1.0] * 6
    with pytest.raises(Exception, match=message):
        scripted(x)
    scripted.block_scale = [1.0] * 6


def test_exported_file_has_the_trainer_contract(tmp_path):
    m = export_models.script(export_models.build("transformer", seed=1))
    path = tmp_path / "transformer.pt"
    m.save(str(path))
    loaded = torch.jit.load(str(path))
    assert loaded.ddpx_input == "tokens" and loaded.num_classes == 4
    assert (loaded.vocab_size, loaded.sentences, loaded.words) == (500, 6, 8)
    assert list(loaded.block_scale) == [1.0] * 6
    units = sorted({n.split(".")[1] for n, _ in loaded.named_parameters() if n.startswith("blocks.")})
    assert units == [str(i) for i in range(6)]
