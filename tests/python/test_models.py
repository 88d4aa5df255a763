"""The scripted models of torchscript_models/ as ddpx-train gets them:
exported by scripts/export_models.py (run here as a subprocess, with and
without --aten), loaded with torch.jit.load, compared to the eager models.

Tolerances (float32): scripted vs eager run the same kernels, rtol 1e-5 /
atol 1e-6. ddpx ops vs ATen ops differ in summation order only: outputs rtol
1e-5 / atol 1e-6, gradients rtol 1e-4 / atol 1e-5 (weight gradients sum over
batch and time, as in test_fused_gru.py).
"""
import os
import subprocess
import sys
import zipfile

import pytest
import torch
from torch.testing import assert_close

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXPORT = os.path.join(ROOT, "scripts", "export_models.py")
# Appended: scripts/ comes after the standard library on sys.path.
sys.path.append(os.path.dirname(EXPORT))
import export_models  # noqa: E402  (also puts plugin/python, hence ddpx.nn, on sys.path)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.load/script

# Small models: intra-op threads only contend on a busy shared runner.
torch.set_num_threads(1)

NAMES = ["lenet", "mlp", "han"]
SEED = 3
FWD_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)


def run_export(out, *extra):
    return subprocess.run([sys.executable, EXPORT, "--out", str(out), "--seed", str(SEED),
                           *extra], capture_output=True, text=True, env=os.environ.copy())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{"ddpx": dir, "aten": dir} of exported models (same seed)."""
    dirs = {}
    for variant, extra in (("ddpx", ()), ("aten", ("--aten",))):
        out = tmp_path_factory.mktemp(variant)
        proc = run_export(out, *extra)
        assert proc.returncode == 0, proc.stderr
        dirs[variant] = out
    return dirs


def load(exported, name, variant="ddpx"):
    return torch.jit.load(str(exported[variant] / f"{name}.pt"))


def make_input(name, n, seed=0):
    """A batch for model `name`: images, or token ids with padded tails, an
    empty sentence in the first document and (n > 2) an all-padding document."""
    g = torch.Generator().manual_seed(seed)
    if name != "han":
        return torch.randn(n, 1, 28, 28, generator=g)
    x = torch.randint(1, 2000, (n, 8, 12), generator=g)
    lengths = torch.randint(1, 13, (n, 8, 1), generator=g)
    x = x * (torch.arange(12) < lengths)
    x[0, 3] = 0
    if n > 2:
        x[2] = 0
    return x


def grads(model, x):
    model.zero_grad()
    out = model(x)
    target = torch.arange(out.size(0)) % out.size(1)
    torch.nn.functional.cross_entropy(out, target).backward()
    return {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("name", NAMES)
def test_attributes(exported, name):
    for variant in ("ddpx", "aten"):
        m = load(exported, name, variant)
        assert m.ddpx_input == ("tokens" if name == "han" else "image")
        assert m.num_classes == (4 if name == "han" else 10)
        assert m.aten_reference == (variant == "aten")
        if name == "han":
            assert (m.vocab_size, m.sentences, m.words) == (2000, 8, 12)


@pytest.mark.parametrize("name", NAMES)
def test_export_is_deterministic_and_variants_share_weights(exported, name):
    eager = export_models.build(name, seed=SEED)
    for variant in ("ddpx", "aten"):
        saved = load(exported, name, variant).state_dict()
        assert saved.keys() == eager.state_dict().keys()
        for k, v in eager.state_dict().items():
            assert torch.equal(saved[k], v), (variant, k)
    other = export_models.build(name, seed=SEED + 1).state_dict()
    assert not all(torch.equal(other[k], v) for k, v in eager.state_dict().items())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [1, 2, 17])
def test_scripted_matches_eager(exported, name, n):
    eager = export_models.build(name, seed=SEED)
    scripted = load(exported, name)
    x = make_input(name, n)
    out = scripted(x)
    assert out.shape == (n, scripted.num_classes) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert_close(out, eager(x), **FWD_TOL)
    g_script, g_eager = grads(scripted, x), grads(eager, x)
    for k, g in g_eager.items():
        assert_close(g_script[k], g, **FWD_TOL, msg=k)


@pytest.mark.parametrize("name", NAMES)
def test_backward_reaches_every_parameter(exported, name):
    m = load(exported, name)
    params = dict(m.named_parameters())
    assert params
    for k, g in grads(m, make_input(name, 5)).items():
        assert g is not None, k
        assert g.shape == params[k].shape and torch.isfinite(g).all(), k
        assert g.abs().sum() > 0, f"{k}: zero gradient"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [1, 17])
def test_aten_variant_matches_ddpx(exported, name, n):
    ours, ref = load(exported, name), load(exported, name, "aten")
    x = make_input(name, n, seed=n)
    assert_close(ours(x), ref(x), **FWD_TOL)
    g_ours, g_ref = grads(ours, x), grads(ref, x)
    for k, g in g_ref.items():
        assert_close(g_ours[k], g, **GRAD_TOL, msg=k)


class Child(torch.nn.Module):
    def __init__(self, child):
        super().__init__()
        self.child = child

    def forward(self, x: torch.Tensor):
        return self.child(x)


@pytest.mark.parametrize("aten", [False, True])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_layers_match_torch_nn(aten, bidirectional):
    """The shared layers are ddpx.nn's drop-ins (aten: torch.nn's own modules):
    an nn.GRU's / nn.Conv2d's state_dict loads and the scripted outputs agree."""
    import ddpx.nn
    from ddpx_layers import conv2d, gru
    torch.manual_seed(0)
    ref = torch.nn.GRU(5, 7, bidirectional=bidirectional, batch_first=True)
    ours = gru(5, 7, bidirectional=bidirectional, aten=aten)
    assert type(ours) is (torch.nn.GRU if aten else ddpx.nn.FusedGRU)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 4, 5)
    # Scripted as a child, as in HAN: a scripted nn.GRU has no forward of its
    # own (nn.GRU.forward is overloaded for PackedSequence).
    for a, b in zip(torch.jit.script(Child(ours))(x), ref(x)):
        assert_close(a, b, **FWD_TOL)
    ref = torch.nn.Conv2d(3, 4, 5, padding=2)
    ours = conv2d(3, 4, 5, padding=2, aten=aten)
    assert type(ours) is (torch.nn.Conv2d if aten else ddpx.nn.TiledConv2d)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 9, 11)
    assert_close(torch.jit.script(ours)(x), ref(x), **FWD_TOL)


def saved_code(path):
    """The TorchScript source of every method of every module in the file."""
    with zipfile.ZipFile(path) as z:
        return "".join(z.read(n).decode() for n in z.namelist() if n.endswith(".py"))


def test_ddpx_variant_calls_the_ddpx_ops(exported):
    """The default export runs the ddpx ops, the --aten one only ATen ops (the
    layer is chosen when building, so its file loads without the plugin)."""
    assert "ddpx.tiled_conv2d" in load(exported, "lenet").conv2._conv_forward.code
    assert "ddpx.fused_gru" in load(exported, "han").word_gru.code
    for name in ("lenet", "han"):
        assert "ops.ddpx." in saved_code(exported["ddpx"] / f"{name}.pt")
        assert "ops.ddpx." not in saved_code(exported["aten"] / f"{name}.pt")
    code = ("import sys, torch\n"
            "m = torch.jit.load(sys.argv[1])\n"
            "print(tuple(m(torch.randint(0, 2000, (2, 8, 12))).shape))\n")
    env = {k: v for k, v in os.environ.items() if k != "DDPX_LIB"}
    proc = subprocess.run([sys.executable, "-c", code, str(exported["aten"] / "han.pt")],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(2, 4)"


def test_han_all_padding_document_is_finite(exported):
    m = load(exported, "han")
    out = m(torch.zeros(3, 8, 12, dtype=torch.int64))
    assert torch.isfinite(out).all()
    # Nothing to attend to: every document pools to zeros, logits = classifier bias.
    assert_close(out, m.classifier.bias.detach().expand(3, 4))


@pytest.mark.parametrize("name,x,match", [
    ("lenet", torch.randn(2, 1, 28), "x must be \\[N, 1, 28, 28\\]"),
    ("lenet", torch.randn(2, 3, 28, 28), "x must be \\[N, 1, 28, 28\\]"),
    ("mlp", torch.randn(2, 1, 28, 28, dtype=torch.float64), "x must be float32"),
    ("han", torch.ones(2, 8, dtype=torch.int64), "x must be \\[N, sentences, words\\]"),
    ("han", torch.ones(2, 8, 12, dtype=torch.int32), "x must be int64"),
    ("han", torch.full((2, 8, 12), 2000), "vocab_size=2000"),
    ("han", torch.full((2, 8, 12), -1), "token ids in"),
])
def test_bad_input_names_argument(exported, name, x, match):
    with pytest.raises(Exception, match=match):
        load(exported, name)(x)
    with pytest.raises(ValueError, match=match):
        export_models.build(name)(x)


def test_export_cli_errors(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DDPX_LIB"}
    proc = subprocess.run([sys.executable, EXPORT, "--out", str(tmp_path)], capture_output=True,
                          text=True, env=env)
    assert proc.returncode == 2 and "--lib is required" in proc.stderr
    proc = run_export(tmp_path, "--lib", str(tmp_path / "nope.so"))
    assert proc.returncode == 2 and "no such file" in proc.stderr
    with pytest.raises(ValueError, match="name must be one of"):
        export_models.build("resnet")
