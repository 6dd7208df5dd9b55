"""The pipeline engine on 2, 3 and 4 gloo ranks against the same layers run in one process.

One launch per world size runs every case (``suite``: the ``PipeCase`` records of ``CASES``, then the
evaluation, checkpoint and parallel-write runs); the tests below check its results against
``tests.harness.pipeline.reference_run`` (the layers one after the other, the same micro-batches, torch's
AdamW).

Tolerance. The pipeline computes every forward and backward operation exactly as the reference does (same
kernels, same inputs), so the only differences are the order of three sums: the tied embedding's gradient
((sum of head parts) + (sum of embedding parts) instead of the per-micro-batch sums autograd makes), the
data-parallel average (a/2 + b/2 instead of (a + b)/2) and the micro-batch accumulation (in the flat ZeRO
buffer instead of per tensor). Each reorders a sum of fp32 terms: a relative change of a few units of
2^-24 = 6e-8 in the affected gradients. AdamW divides each update by sqrt(v), so a relative gradient change
moves each update by the same relative amount, lr = 3e-3 times it: after 50 steps the weights move by at
most 50 * 3e-3 * (a few) * 6e-8 ~ 1e-10 absolute beyond what the rounding of the weights themselves gives,
far inside the issue's bound of 1e-6 relative, which the tests check (measured: ~1e-7 for the losses,
~5e-8 for the weights).
"""
from __future__ import annotations

import functools
import shutil
import tempfile
from typing import Any

import numpy as np
import pytest
import torch

from dsrun.pipe import p2p
from tests.harness import pipeline
from tests.harness.pipeline import PipeCase, build_engine, named_params, pipe_suite, replica_batches, train
from tests.helpers import run_ranks

TOL = 1e-6
PARITY_STEPS = 50
SCHEDULES = ("gpipe", "zero_bubble", "interleaved")
CASES = [
    PipeCase("lm/1f1b", "lm", 2, 4, PARITY_STEPS),
    *(PipeCase(f"lm/{schedule}", "lm", 2, 4, 8,
               config={"pipeline": {"schedule": schedule, **({"virtual_stages": 2} if schedule == "interleaved"
                                                             else {})}}) for schedule in SCHEDULES),
    PipeCase("masked/zero2", "masked", 2, 4, 6, zero_stage=2),
    PipeCase("masked/zero0", "masked", 2, 4, 6, zero_stage=0),
    PipeCase("lm/varlen", "lm", 2, 4, 6, varying_seq=True),
    PipeCase("tokens/3", "tokens", 3, 3, 6, worlds=(3,)),
    PipeCase("lm/3", "lm", 3, 6, 6, worlds=(3,), config={"pipeline": {"schedule": "zero_bubble"}}),
    PipeCase("lm/2x2", "lm", 2, 4, PARITY_STEPS, worlds=(4,)),
    # a model axis: each model-parallel rank sends half of every message, or all
    *(PipeCase(f"lm/mp/{on}", "lm", 2, 4, 4, worlds=(4,), model_parallel=2,
               config={"pipeline": {"pipe_partitioned": on, "grad_partitioned": on}}) for on in (True, False)),
]


def eval_case(stages: int, micro_batches: int) -> dict[str, Any]:
    """Per-micro-batch losses of eval_batch at the initial weights (each micro-batch with its own labels)."""
    engine = build_engine("lm", stages, micro_batches)
    d = engine.grid.get_data_parallel_id()
    per_micro = engine.eval_batch(iter(replica_batches(0, micro_batches, d)), reduce_output=None)
    mean = engine.eval_batch(iter(replica_batches(0, micro_batches, d)))
    engine.destroy()
    return {"per_micro": [float(x) for x in per_micro], "mean": float(mean)}


def checkpoint_case(save_dir: str, world: int, micro_batches: int = 4) -> dict[str, Any]:
    """2 stages (x world/2 data) -> save -> 1 stage (x world data) loads and continues -> save -> 2 stages
    load and continue; against the run that never stopped."""
    first, more = 3, 3
    out: dict[str, Any] = {}
    two_stage_gas = micro_batches * 2 // world  # the same micro-batches per step, however they are spread
    one_stage_gas = micro_batches // world
    a = build_engine("lm", 2, two_stage_gas)
    out["a_first"] = train(a, first)
    a.save_checkpoint(save_dir, tag="two_stages")
    out["a_saved"] = named_params(a)
    out["a_files"] = sorted(a.last_checkpoint_files)
    out["a_more"] = train(a, 2 * more, first_step=first)
    a.destroy()

    b = build_engine("lm", 1, one_stage_gas)
    b.load_checkpoint(save_dir, tag="two_stages")
    out["b_loaded"] = named_params(b)
    out["b_steps"] = b.global_steps
    out["b_more"] = train(b, more, first_step=first)
    b.save_checkpoint(save_dir, tag="one_stage")
    out["b_saved"] = named_params(b)
    b.destroy()

    c = build_engine("lm", 2, two_stage_gas)
    c.load_checkpoint(save_dir, tag="one_stage")
    out["c_loaded"] = named_params(c)
    out["c_more"] = train(c, more, first_step=first + more)
    c.destroy()
    return out


def parallel_write_case(save_dir: str) -> dict[str, Any]:
    """Which files each rank writes, with and without checkpoint.parallel_write.pipeline_stage."""
    out = {}
    for flag in (False, True):
        engine = build_engine("lm", 2, 2, checkpoint={"parallel_write": {"pipeline_stage": flag}})
        engine.save_checkpoint(save_dir, tag=f"parallel_{flag}")
        out[flag] = sorted(f for f in engine.last_checkpoint_files if f.startswith("layer_"))
        engine.destroy()
    return out


def rank_suite(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    """Rank entry point: every pipeline run one launch makes for world size ``world`` (one launch per size)."""
    out: dict[str, Any] = pipe_suite(rank, world, CASES)
    if world == 2:
        out["eval"] = eval_case(2, 4)
    if world in (2, 4):
        out["ckpt"] = checkpoint_case(f"{save_dir}/ckpt", world)
    if world == 4:
        out["write"] = parallel_write_case(f"{save_dir}/parallel")
    return out

pytestmark = pytest.mark.slow  # one multi-process launch per world size


@functools.lru_cache(maxsize=None)
def suite(world: int) -> list[dict]:
    save_dir = tempfile.mkdtemp(prefix="dsrun-pipe-")
    try:
        return run_ranks(rank_suite, world, save_dir, timeout=900)
    finally:
        shutil.rmtree(save_dir, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def reference(model: str, steps: int, micro_batches: int, replicas: int, varying: bool = False) -> dict:
    return pipeline.reference_run(model, steps, micro_batches, replicas, pipeline.varying_seq if varying else None)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def check_parity(results: list[dict], key: str, ref: dict) -> None:
    for r in results:  # every rank reports the same loss (the last stage's, broadcast)
        for step, (a, b) in enumerate(zip(r[key]["losses"], ref["losses"])):
            assert rel(a, b) <= TOL, f"{key} step {step}: loss {a} vs reference {b}"
    got: dict[str, np.ndarray] = {}
    for r in results:
        for name, value in r[key]["params"].items():
            if name in got:  # a weight tied across stages: the copies are identical, bit for bit
                np.testing.assert_array_equal(value, got[name], err_msg=f"{key}: tied copies of {name} differ")
            got[name] = value
    assert set(got) == set(ref["params"]), f"{key}: parameter names differ from the reference"
    scale = max(float(p.abs().max()) for p in ref["params"].values())
    worst = max(float((torch.as_tensor(v) - ref["params"][n]).abs().max()) for n, v in got.items()) / scale
    assert worst <= TOL, f"{key}: final weights differ by {worst:.2e} (relative to the largest weight)"


def test_two_stages_on_two_ranks_match_the_plain_model_over_50_steps() -> None:
    results = suite(2)
    check_parity(results, "lm/1f1b", reference("lm", PARITY_STEPS, 4, 1))
    for r in results:
        got = r["lm/1f1b"]
        assert got["global_steps"] == PARITY_STEPS and got["micro_steps"] == 4 * PARITY_STEPS
        assert got["global_samples"] == PARITY_STEPS * 4 * pipeline.MICRO
    # the tied embedding lives on both stages
    assert all("tied_modules.embed.weight" in r["lm/1f1b"]["params"] for r in results)


def test_two_stages_by_two_data_parallel_on_four_ranks_match_over_50_steps() -> None:
    check_parity(suite(4), "lm/2x2", reference("lm", PARITY_STEPS, 4, 2))


@pytest.mark.parametrize("schedule", ["gpipe", "zero_bubble", "interleaved"])
def test_every_schedule_trains_the_same_model(schedule: str) -> None:
    check_parity(suite(2), f"lm/{schedule}", reference("lm", 8, 4, 1))


def test_zero_bubble_at_three_stages() -> None:
    check_parity(suite(3), "lm/3", reference("lm", 6, 6, 1))


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_non_grad_float_outputs_cross_stages(zero_stage: int) -> None:
    """Stage 0 sends (hidden, mask) where the mask is a float tensor that needs no gradient (DeepSpeed hangs
    on it); ZeRO-0 and ZeRO-2 here, ZeRO-1 everywhere else."""
    check_parity(suite(2), f"masked/zero{zero_stage}", reference("masked", 6, 4, 1))


def test_int64_tensors_travel_through_three_stages() -> None:
    check_parity(suite(3), "tokens/3", reference("tokens", 6, 3, 1))


def test_sequence_length_varies_per_micro_batch() -> None:
    check_parity(suite(2), "lm/varlen", reference("lm", 6, 4, 1, varying=True))


def test_labels_stay_with_their_micro_batch() -> None:
    """eval_batch's loss per micro-batch equals the reference's loss of that micro-batch: the last stage
    pairs each activation with the labels loaded for the same micro-batch."""
    results = suite(2)
    ref = reference("lm", 1, 4, 1)["per_micro"][0]
    last = results[-1]["eval"]
    assert len(last["per_micro"]) == 4 and len(set(last["per_micro"])) == 4
    for a, b in zip(last["per_micro"], ref):
        assert rel(a, b) <= TOL
    for r in results:  # the mean is broadcast to every stage
        assert rel(r["eval"]["mean"], sum(ref) / 4) <= TOL


def _merged(results: list[dict], key: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for r in results:
        out.update(r["ckpt"][key])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_checkpoint_saved_at_two_stages_loads_at_one_and_back(world: int) -> None:
    results = suite(world)
    saved_a, saved_b = _merged(results, "a_saved"), _merged(results, "b_saved")
    for r in results:
        c = r["ckpt"]
        assert c["b_steps"] == 3
        for name, value in c["b_loaded"].items():  # identical weights after the load, bit for bit
            np.testing.assert_array_equal(value, saved_a[name], err_msg=name)
        for name, value in c["c_loaded"].items():
            np.testing.assert_array_equal(value, saved_b[name], err_msg=name)
        # the loss continues as if training had never stopped (the same micro-batches, spread differently)
        for a, b in zip(c["b_more"] + c["c_more"], c["a_more"]):
            assert rel(a, b) <= TOL
    stage0 = results[0]["ckpt"]["a_files"]
    assert "layer_00-model_states.pt" in stage0 and "mp_rank_00_model_states.pt" in stage0
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in stage0
    assert "mp_rank_01_model_states.pt" in results[world // 2]["ckpt"]["a_files"]  # stage 1, data rank 0


def test_model_axis_splits_messages_when_partitioned() -> None:
    """pipe_partitioned / grad_partitioned with a model axis of 2: the same training, each model-parallel rank
    sending half of every activation and gradient (plus the headers), all-gathered on arrival."""
    results = suite(4)
    ref = reference("lm", 4, 4, 1)
    for on in (True, False):
        check_parity(results, f"lm/mp/{on}", ref)
    for r in results[:2]:  # stage 0 sends activations; headers are equal in both runs
        whole, half = r["lm/mp/False"]["sent_bytes"], r["lm/mp/True"]["sent_bytes"]
        payload = 2 * (whole - half)  # whole = headers + payload, half = headers + payload / 2
        assert whole - payload == 4 * p2p.HEADER_LEN * 8  # one int64 header per micro-batch's activation
        assert payload == 4 * pipeline.MICRO * pipeline.SEQ * pipeline.WIDTH * 4  # [micro, seq, width] fp32 per micro-batch


def test_interleaving_cuts_the_model_into_stages_times_virtual_stages() -> None:
    assert len(suite(2)[0]["lm/interleaved"]["parts"]) == 2 * 2 + 1
    assert len(suite(2)[0]["lm/1f1b"]["parts"]) == 2 + 1


def test_parallel_write_spreads_layer_files_over_data_parallel_ranks() -> None:
    """checkpoint.parallel_write.pipeline_stage: off, data rank 0 of each stage writes its layers; on, the
    stage's data-parallel ranks share them."""
    results = suite(4)  # ranks 0, 1: stage 0 (layers 0-3); ranks 2, 3: stage 1 (layers 4-6)
    off = [r["write"][False] for r in results]
    on = [r["write"][True] for r in results]
    assert off[1] == [] and off[3] == [] and len(off[0]) == 4 and len(off[2]) == 3
    assert sorted(on[0] + on[1]) == off[0] and sorted(on[2] + on[3]) == off[2]
    assert all(on)
