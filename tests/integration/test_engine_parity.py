"""The engine against single-process PyTorch, over 1-4 gloo ranks and ZeRO stages 0-2.

One launch per world size runs every case (the records of ``CASES``); the tests below check its
results. Every bound is derived from the arithmetic on the machine running the test
(tests/tolerance.py): fp32 runs must track the fp32 reference within ``(K + 1) x`` the spread
of equally valid fp32 orderings of the same run around its float64 run (losses at every one of 20 steps,
the final parameters relative to the largest, clipping's global norms); mixed precision must track the fp32
reference within ``K x`` the spread of PyTorch's own bf16/fp16 runs (fp32 master weights) around it.
Measured on a 2-core x86-64 box: fp32 losses and parameters 0.05-0.2x their bound; bf16 and fp16 0.04-0.3x.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

from tests import tolerance as t
from tests.harness.launch import Launch
from tests.harness.models import build_model, flat_params, global_batch, loss_terms, slice_batch
from tests.harness.runs import STEPS, Case, ds_config, reference_run, world_suite


def _cases() -> list[Case]:
    """Every engine run, as records; one launch per world size runs those of that size (process start-up is
    the slow part on a small machine)."""
    cases = []
    for world in WORLDS:
        for name in ("mlp", "gpt"):
            for stage in (0, 1, 2):
                # alternate overlap_comm so both reduction paths of every stage run at some world size
                overlap = (stage + world) % 2 == 0
                cases.append(Case(f"parity/{name}/{stage}", name, ds_config(
                    stage, 2, 1, bucket=3000 if name == "gpt" else 300, zero_optimization={"overlap_comm": overlap}),
                    worlds=(world,)))
    for stage in (0, 1, 2):
        cases.append(Case(f"gas4/{stage}", "mlp", ds_config(stage, 1, 4, bucket=300)))
        cases.append(Case(f"gas1/{stage}", "mlp", ds_config(stage, 4, 1, bucket=300)))
    cases += [Case(f"clip/{stage}", "gpt", ds_config(stage, 2, 1, gradient_clipping=0.05)) for stage in (1, 2)]
    cases += [Case(f"bf16/{stage}", "gpt", ds_config(stage, 2, 1, bf16={"enabled": True})) for stage in (0, 2)]
    cases += [Case(f"comm_bf16/{stage}", "gpt", ds_config(stage, 2, 1, communication_data_type="bf16"))
              for stage in (0, 2)]
    cases.append(Case("allreduce/1", "gpt", ds_config(1, 2, 1, zero_optimization={"reduce_scatter": False})))
    cases.append(Case("prescale/1", "gpt", ds_config(1, 2, 1, prescale_gradients=True, gradient_predivide_factor=2.0)))
    cases += [Case(f"fp16/{stage}", "gpt", ds_config(stage, 2, 1, fp16={"enabled": True, "initial_scale_power": 10}))
              for stage in (1, 2)]
    return cases


def engine_suite(rank: int, world: int) -> dict[str, Any]:
    """Rank entry point: every case of this world size, and at two ranks the fp16 overflow and loader runs."""
    results = world_suite(rank, world, CASES)
    if world == 2:
        results["fp16_overflow/2"] = fp16_overflow_ranks(rank, world, 2)
        results["loader"] = loader_indices(rank, world)
    return results


def loader_indices(rank: int, world: int) -> list[list[int]]:
    """The sample indices this rank's ``training_data`` loader yields over two epochs."""
    import dsrun

    data = torch.utils.data.TensorDataset(torch.arange(12))
    _, _, loader, _ = dsrun.initialize(model=build_model("mlp"), config=ds_config(0, 3, 1), training_data=data)
    return [[int(i) for (batch,) in loader for i in batch] for _ in range(2)]


def fp16_overflow_ranks(rank: int, world: int, stage: int) -> list[dict[str, Any]]:
    """fp16 with an inf injected into one gradient on the last rank only, at optimizer step 2 (checked by
    test_engine_faults.py)."""
    import dsrun

    cfg = ds_config(stage, 2, 1, fp16={"enabled": True, "initial_scale_power": 10, "loss_scale_window": 3,
                                       "hysteresis": 1},
                    scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                              "warmup_num_steps": 10, "warmup_type": "linear"}})
    model = build_model("gpt")
    engine, _, _, scheduler = dsrun.initialize(model=model, config=cfg)
    inject = {"on": False}
    # wte is at the start of the flat buffer, so at stages 1-2 rank 0 owns it: the overflow happens in
    # rank 0's partition while the last rank (which injected it) holds finite gradients
    engine.module.wte.weight.register_hook(lambda g: g * float("inf") if inject["on"] else g)
    records = []
    for step in range(7):
        inject["on"] = step == 2 and rank == world - 1
        batch = global_batch("gpt", step, 2 * world)
        before = flat_params(engine.module)
        loss = engine(slice_batch(batch, 2 * rank, 2 * rank + 2))
        engine.backward(loss)
        engine.step()
        records.append({"scale": engine.cur_scale, "skipped": engine.skipped_steps,
                        "changed": bool((flat_params(engine.module) != before).any()),
                        "sched_iter": scheduler.last_batch_iteration, "lr": engine.get_lr()[0],
                        "global_steps": engine.global_steps})
    return records


@functools.lru_cache(maxsize=None)
def spread(name: str, global_size: int, clip: float = 0.0, dtype: torch.dtype = torch.float32,
           loss_scale: float = 1.0) -> t.Spread:
    """The reference and its rounding spread (its ``reference`` is the single-process PyTorch run)."""
    def run(d: torch.dtype, parts: int, reverse: bool) -> dict:
        return reference_run(name, STEPS, global_size, clip, d, parts, reverse, loss_scale)
    return t.spread(run, dtype, loss_terms(name, global_size))


# Each world size is one multi-process launch (tens of seconds on a loaded 2-core machine): all slow.
pytestmark = pytest.mark.slow
WORLDS = [1, 2, 3, 4]
CASES = _cases()
LAUNCHES = {world: Launch(engine_suite, world, timeout=600) for world in WORLDS}


@pytest.mark.parametrize("case,world", [pytest.param(case, world, id=f"{case.key}-world{world}") for case in CASES
                                        if case.key.startswith("parity/") for world in case.worlds])
def test_fp32_matches_single_process_pytorch(runs, case: Case, world: int) -> None:
    results, key = runs[world], case.key
    s = spread(case.model, case.global_size(world))
    got = results[0][key]
    t.assert_tracks(got, s.reference, s, f"{key} world={world}")
    for other in results[1:]:  # every rank ends with the same model
        np.testing.assert_array_equal(other[key]["params"], got["params"])
    assert got["global_steps"] == STEPS and got["micro_steps"] == STEPS
    assert got["global_samples"] == STEPS * case.global_size(world)


def test_gradient_accumulation_equals_larger_micro_batch(runs) -> None:
    results = runs[2][0]
    for stage in (0, 1, 2):
        accumulated, whole = results[f"gas4/{stage}"], results[f"gas1/{stage}"]
        s = spread("mlp", 8)
        t.assert_tracks(accumulated, whole, s, f"gas4 vs gas1, stage {stage}", against="run")
        t.assert_tracks(accumulated, s.reference, s, f"gas4, stage {stage}")
        assert accumulated["micro_steps"] == 4 * STEPS and accumulated["global_steps"] == STEPS


def test_clipping_under_partitioning_matches_clip_grad_norm(runs) -> None:
    results = runs[2][0]
    s = spread("gpt", 4, 0.05)
    assert min(s.reference["norms"]) > 0.05  # the clip is active at every step
    for stage in (1, 2):
        t.assert_tracks(results[f"clip/{stage}"], s.reference, s, f"clip, stage {stage}",
                        what=("losses", "norms", "params"))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32(runs, precision: str) -> None:
    results = runs[2][0]
    # fp16 runs at the engine's initial loss scale (2**10; the test asserts no step overflowed)
    s = spread("gpt", 4, dtype=getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[precision]),
               loss_scale=2.0 ** 10 if precision == "fp16" else 1.0)
    keys = [k for k in results if k.startswith(precision + "/")]
    assert keys
    for key in keys:
        assert results[key]["skipped"] == 0
        t.assert_tracks(results[key], s.wide, s, key, against="wide")


@pytest.mark.parametrize("world", [2, 4])
def test_memory_breakdown_partitions_optimizer_state_and_gradients(runs, world: int) -> None:
    results = runs[world][0]
    for name in ("mlp", "gpt"):
        m0, m1, m2 = (results[f"parity/{name}/{s}"]["memory"] for s in (0, 1, 2))
        padding_allowance = 2 * world * 4 * 3  # at most 2N padded fp32 elements per state tensor
        for m in (m1, m2):
            assert abs(m["optimizer_states"] - m0["optimizer_states"] / world) <= padding_allowance
        assert abs(m2["gradients"] - m0["gradients"] / world) <= padding_allowance
        assert m1["gradients"] >= m0["gradients"]  # stage 1 keeps full gradients
        assert m0["parameters"] <= m1["parameters"] == m2["parameters"]  # parameters are not partitioned


@pytest.mark.parametrize("world", [2, 3])
def test_comm_bytes_per_step_match_theory(runs, world: int) -> None:
    results = runs[world][0]
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


def test_communication_options(runs) -> None:
    results = runs[2][0]
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


def test_training_data_loader_shards_across_ranks(runs) -> None:
    per_rank = [results["loader"] for results in runs[2]]
    for epoch in range(2):
        shards = [set(r[epoch]) for r in per_rank]
        assert all(len(r[epoch]) == 6 for r in per_rank)  # micro-batches of 3, 6 samples per rank
        assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == set(range(12))
    assert per_rank[0][0] != per_rank[0][1]  # reshuffled each epoch
