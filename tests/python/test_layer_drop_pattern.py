"""The layer-drop pattern (ddpx/layer_drop.h) through torch.ops.ddpx.layer_drop_scales,
the function ddpx-train calls (issue 25): the same pattern on every rank
for the same (seed, step) and a different one per rank in per-rank mode;
every block kept with its schedule's probability; the kept blocks' scale;
TorchScript; bad arguments named.

Frequencies are checked over 4000 steps to 5 standard deviations (a correct
generator fails such a check about once in 1.7 million runs).
"""
import math

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script
STEPS = 4000  # (conftest.py has loaded libddpx)


def draw(schedule, step, depth=6, **kw):
    return torch.ops.ddpx.layer_drop_scales(schedule, step, depth, **kw)


def keep_freq(schedule, depth, first=0, **kw):
    kept = [0] * depth
    for t in range(first, first + STEPS):
        for b, s in enumerate(draw(schedule, t, depth, **kw)):
            kept[b] += s != 0
    return [k / STEPS for k in kept]


def assert_freq(got, p):
    sigma = math.sqrt(max(p * (1 - p), 1e-12) / STEPS)
    assert abs(got - p) <= 5 * sigma + 1e-12, (got, p)


def test_shared_pattern_is_the_same_on_every_rank_and_call():
    for t in range(50):
        ref = draw("constant:0.4", t, rank=0)
        assert draw("constant:0.4", t, rank=1) == ref == draw("constant:0.4", t, rank=2)
        assert draw("constant:0.4", t, rank=0) == ref  # a pure function of (seed, step)


def test_per_rank_patterns_differ_between_ranks_and_from_the_shared_one():
    differ = sum(draw("constant:0.4", t, pattern="per-rank", rank=0)
                 != draw("constant:0.4", t, pattern="per-rank", rank=1) for t in range(50))
    shared = sum(draw("constant:0.4", t, pattern="per-rank", rank=0) != draw("constant:0.4", t)
                 for t in range(50))
    # Two independent patterns of 6 blocks at p = 0.6 agree with chance
    # (0.6^2 + 0.4^2)^6 = 0.0095 per step.
    assert differ >= 40 and shared >= 40, (differ, shared)


def test_another_seed_draws_another_pattern():
    same = sum(draw("constant:0.5", t, seed=1) == draw("constant:0.5", t, seed=2)
               for t in range(100))
    assert same < 10, same  # chance: 0.5^6 = 1.6% per step


def test_constant_keeps_every_block_with_one_minus_p():
    for b, f in enumerate(keep_freq("constant:0.3", 6)):
        assert_freq(f, 0.7)


def test_stochastic_depth_is_linear_in_depth():
    for b, f in enumerate(keep_freq("stochastic-depth:0.5", 4)):
        assert_freq(f, 1 - (b + 1) / 4 * 0.5)


def test_pld_starts_with_every_block_and_falls_to_theta():
    for t in range(3):
        assert draw("pld:0.5", 0, pld_gamma=0.01) == [1.0] * 6  # theta(0) = 1
    # Long after: theta(t) = 0.5, keep = 1 - (l / L) 0.5.
    for b, f in enumerate(keep_freq("pld:0.5", 6, first=10000, pld_gamma=0.01)):
        assert_freq(f, 1 - (b + 1) / 6 * 0.5)


def test_kept_blocks_are_scaled_by_one_over_their_keep_probability():
    depth, t, gamma = 6, 40, 0.02
    theta = 0.5 * math.exp(-gamma * t) + 0.5
    s = draw("pld:0.5", t, depth, pld_gamma=gamma)
    for b, v in enumerate(s):
        if v:
            assert v == pytest.approx(1 / (1 - (b + 1) / depth * (1 - theta)), rel=1e-12)
    assert all(v in (0.0, 1.0) for v in draw("pld:0.5", t, depth, pld_gamma=gamma, scale="none"))
    # The same blocks are dropped whatever the scale.
    assert [v == 0 for v in s] == [v == 0 for v in draw("pld:0.5", t, depth, pld_gamma=gamma,
                                                       scale="none")]
    assert draw("none", 5) == [1.0] * 6 and draw("constant:0.5", 3, 0) == []


def test_torchscript_calls_it():
    @torch.jit.script
    def pattern(step: int) -> list[float]:
        return torch.ops.ddpx.layer_drop_scales("constant:0.5", step, 4)

    assert pattern(7) == draw("constant:0.5", 7, 4)


@pytest.mark.parametrize("args,kw,message", [
    (("often", 0, 6), {}, "--layer-drop must be none, constant:P"),
    (("constant:1", 0, 6), {}, r"must be in \[0, 1\)"),
    (("constant:0.2x", 0, 6), {}, r"must be in \[0, 1\)"),
    (("pld:0", 0, 6), {}, "theta-bar"),
    (("pld:0.5", 0, 6), {"pld_gamma": -1.0}, "--pld-gamma must be >= 0"),
    (("constant:0.2", 0, 6), {"pattern": "mine"}, "must be shared or per-rank"),
    (("constant:0.2", 0, 6), {"scale": "half"}, "must be inverse or none"),
    (("constant:0.2", 0, -1), {}, "depth must be >= 0"),
    (("constant:0.2", -1, 6), {}, "step must be >= 0"),
])
def test_bad_arguments_are_named(args, kw, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.ddpx.layer_drop_scales(*args, **kw)
