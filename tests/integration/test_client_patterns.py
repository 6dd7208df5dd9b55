"""Real DeepSpeed client code patterns, each against plain PyTorch (issue 17).

The GAN of DeepSpeedExamples clears the discriminator's gradients itself, runs two backward passes through it
before one step, and lets the generator's loss flow back through it without stepping it. Every ZeRO stage must
then apply exactly torch's gradients, whatever the script did to ``.grad`` (set to None, zeroed, replaced).

Tolerance: the engine and the reference compute the same fp32 gradients and differ only in the order the two
ranks' halves are summed (a few fp32 ulps), which Adam's normalised update passes on as ~ulp * lr per step,
far below the rounding of the stored weights themselves. So the weights may differ by the fp32 rounding of
each update: 16 ulps of the largest weight (16 * 2**-23 * max|w|, ~1e-6 here) bounds 6 steps with room to
spare, and is three orders below the defect this guards against, where whole steps were built from
discarded gradients (errors the size of the moves, ~lr = 2e-3).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.helpers import run_ranks
from tests.integration import _client_workloads as cw

STEPS, MICRO, WORLD = 6, 4, 2


@functools.lru_cache(maxsize=None)
def gan_reference(how: str) -> dict:
    return cw.gan_reference(STEPS, MICRO * WORLD, how)


HOWS = ("none", "zero", "assign")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gan_step_pattern_matches_torch(stage: int) -> None:
    ranks = run_ranks(cw.gan_ranks, WORLD, stage, HOWS, STEPS, MICRO, timeout=180)
    for how in HOWS:
        ref = gan_reference(how)
        scale = np.abs(np.concatenate([ref["d"], ref["g"]]) - ref["start"]).max()
        assert scale > 1e-3  # the weights really moved
        for net in ("d", "g"):
            got = ranks[0][how][net]
            err = np.abs(got - ref[net]).max()
            assert err <= 16 * 2.0**-23 * np.abs(ref[net]).max(), f"stage {stage}, grads {how}: {net} differs from torch by {err:.3e}"
            np.testing.assert_array_equal(ranks[1][how][net], got)  # every rank holds the same model


def test_zero3_gathers_parameters_read_outside_their_module() -> None:
    """nn.MultiheadAttention, nn.TransformerEncoderLayer, a parent multiplying by its child's weight and a
    tied head in the root's forward train at ZeRO-3 as in torch, and evaluate through MHA's inference path.
    Losses: the same weights to 16 ulps give the same cross-entropy to ~1e-6 relative; 1e-5 is the bound."""
    steps, micro = 4, 3
    ref = cw.readers_reference(steps, micro * WORLD)
    ranks = run_ranks(cw.readers_ranks, WORLD, steps, micro, timeout=180)
    got = ranks[0]
    for a, b in zip(got["losses"] + [got["eval"]], ref["losses"] + [ref["eval"]]):
        assert abs(a - b) <= 1e-5 * abs(b), f"loss {a} vs torch {b}"
    assert np.abs(got["params"] - ref["params"]).max() <= 16 * 2.0**-23 * np.abs(ref["params"]).max()
    np.testing.assert_array_equal(ranks[1]["params"], got["params"])
