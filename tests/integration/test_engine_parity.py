"""The engine against single-process PyTorch, over 1-4 gloo ranks and ZeRO stages 0-2.

One launch per world size runs every case (see ``_workloads.suite_cases``); the tests below check its
results. Every bound is derived from the arithmetic on the machine running the test
(tests/tolerance.py): fp32 runs must track the fp32 reference within ``(K + 1) x`` the spread
of equally valid fp32 orderings of the same run around its float64 run (losses at every one of 20 steps,
the final parameters relative to the largest, clipping's global norms); mixed precision must track the fp32
reference within ``K x`` the spread of PyTorch's own bf16/fp16 runs (fp32 master weights) around it.
Measured on a 2-core x86-64 box: fp32 losses and parameters 0.05-0.2x their bound; bf16 and fp16 0.04-0.3x.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tests.helpers import run_ranks
from tests import tolerance as t
from tests.integration import _workloads as w


@functools.lru_cache(maxsize=None)
def suite(world: int) -> list[dict]:
    return run_ranks(w.world_suite, world, timeout=600)


@functools.lru_cache(maxsize=None)
def spread(name: str, global_size: int, clip: float = 0.0, dtype: torch.dtype = torch.float32,
           loss_scale: float = 1.0) -> t.Spread:
    """The reference and its rounding spread (its ``reference`` is the single-process PyTorch run)."""
    def run(d: torch.dtype, parts: int, reverse: bool) -> dict:
        return w.reference_run(name, w.STEPS, global_size, clip, d, parts, reverse, loss_scale)
    return t.spread(run, dtype, w.loss_terms(name, global_size))


def _global_size(cfg: dict, world: int) -> int:
    return cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * world


# Each world size is one multi-process launch (tens of seconds on a loaded 2-core machine): all slow.
pytestmark = pytest.mark.slow
WORLDS = [1, 2, 3, 4]


@pytest.mark.parametrize("world", WORLDS)
def test_fp32_matches_single_process_pytorch(world: int) -> None:
    results = suite(world)
    for key, (name, cfg) in w.suite_cases(world).items():
        if not key.startswith("parity/"):
            continue
        s = spread(name, _global_size(cfg, world))
        got = results[0][key]
        t.assert_tracks(got, s.reference, s, f"{key} world={world}")
        for other in results[1:]:  # every rank ends with the same model
            np.testing.assert_array_equal(other[key]["params"], got["params"])
        assert got["global_steps"] == w.STEPS and got["micro_steps"] == w.STEPS
        assert got["global_samples"] == w.STEPS * _global_size(cfg, world)


def test_gradient_accumulation_equals_larger_micro_batch() -> None:
    results = suite(2)[0]
    for stage in (0, 1, 2):
        accumulated, whole = results[f"gas4/{stage}"], results[f"gas1/{stage}"]
        s = spread("mlp", 8)
        t.assert_tracks(accumulated, whole, s, f"gas4 vs gas1, stage {stage}", against="run")
        t.assert_tracks(accumulated, s.reference, s, f"gas4, stage {stage}")
        assert accumulated["micro_steps"] == 4 * w.STEPS and accumulated["global_steps"] == w.STEPS


def test_clipping_under_partitioning_matches_clip_grad_norm() -> None:
    results = suite(2)[0]
    s = spread("gpt", 4, 0.05)
    assert min(s.reference["norms"]) > 0.05  # the clip is active at every step
    for stage in (1, 2):
        t.assert_tracks(results[f"clip/{stage}"], s.reference, s, f"clip, stage {stage}",
                        what=("losses", "norms", "params"))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32(precision: str) -> None:
    results = suite(2)[0]
    # fp16 runs at the engine's initial loss scale (2**10; the test asserts no step overflowed)
    s = spread("gpt", 4, dtype=getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[precision]),
               loss_scale=2.0 ** 10 if precision == "fp16" else 1.0)
    keys = [k for k in results if k.startswith(precision + "/")]
    assert keys
    for key in keys:
        assert results[key]["skipped"] == 0
        t.assert_tracks(results[key], s.wide, s, key, against="wide")


@pytest.mark.parametrize("world", [2, 4])
def test_memory_breakdown_partitions_optimizer_state_and_gradients(world: int) -> None:
    results = suite(world)[0]
    for name in ("mlp", "gpt"):
        m0, m1, m2 = (results[f"parity/{name}/{s}"]["memory"] for s in (0, 1, 2))
        padding_allowance = 2 * world * 4 * 3  # at most 2N padded fp32 elements per state tensor
        for m in (m1, m2):
            assert abs(m["optimizer_states"] - m0["optimizer_states"] / world) <= padding_allowance
        assert abs(m2["gradients"] - m0["gradients"] / world) <= padding_allowance
        assert m1["gradients"] >= m0["gradients"]  # stage 1 keeps full gradients
        assert m0["parameters"] <= m1["parameters"] == m2["parameters"]  # parameters are not partitioned


@pytest.mark.parametrize("world", [2, 3])
def test_comm_bytes_per_step_match_theory(world: int) -> None:
    results = suite(world)[0]
    for name in ("mlp", "gpt"):
        for stage in (0, 1, 2):
            got = results[f"parity/{name}/{stage}"]
            psi, nbytes = got["numel"], 4
            theory = 2 * psi * nbytes * (world - 1) / world
            comm = got["comm"]
            # the test's own loss all-reduce (one float64) and the overflow/norm flags are tiny extras
            moved = sum(v["traffic_bytes"] for op, v in comm.items() if op != "all_reduce" or stage == 0)
            if stage == 0:
                moved -= 2 * 8 * (world - 1) / world
                assert moved == pytest.approx(theory, rel=1e-9)
                assert set(comm) == {"all_reduce"}
            else:
                assert {"reduce_scatter", "all_gather"} <= set(comm)
                # padding to a multiple of 2N elements adds at most 2N elements per collective pair
                assert moved == pytest.approx(theory, abs=2 * 2 * world * nbytes)


def test_communication_options() -> None:
    results = suite(2)[0]
    # bf16 communication rounds the reduced gradients to bf16; a bf16 model rounds those and its weights and
    # activations too, so the bf16 spread bounds it
    bf16, s = spread("gpt", 4, dtype=torch.bfloat16), spread("gpt", 4)
    for stage in (0, 2):
        got = results[f"comm_bf16/{stage}"]
        t.assert_tracks(got, bf16.wide, bf16, f"comm_bf16/{stage}", against="wide")
        # gradients travel in bf16: half the bytes of the fp32 runs
        fp32 = results[f"parity/gpt/{stage}"]["comm"]
        op = "all_reduce" if stage == 0 else "reduce_scatter"
        assert got["comm"][op]["message_bytes"] * 2 == pytest.approx(fp32[op]["message_bytes"], abs=16)
    # prescale: divide by 2 before the sum and by N/2 after; reduce_scatter false: all-reduce, keep own piece
    for key in ("prescale/1", "allreduce/1"):
        t.assert_tracks(results[key], s.reference, s, key)
    assert "reduce_scatter" not in results["allreduce/1"]["comm"]


def test_training_data_loader_shards_across_ranks() -> None:
    per_rank = [results["loader"] for results in suite(2)]
    for epoch in range(2):
        shards = [set(r[epoch]) for r in per_rank]
        assert all(len(r[epoch]) == 6 for r in per_rank)  # micro-batches of 3, 6 samples per rank
        assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == set(range(12))
    assert per_rank[0][0] != per_rank[0][1]  # reshuffled each epoch
