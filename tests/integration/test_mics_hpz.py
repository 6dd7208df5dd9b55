"""MiCS and hpZ on 4 gloo ranks against plain ZeRO-3 (one launch of ``suite``: the runs are ``Case`` records of
the ZeRO-3 GPT, tests/harness/runs.py, each counting which process groups carried its last step's collectives).

MiCS changes how the gradient sum is grouped (reduce-scatter over a shard group of 2, then all-reduce across
the 2 replicas): another valid fp32 ordering, so its losses and final parameters must stay within the
derived bound between two runs (tests/tolerance.py). Everything else here does the same arithmetic as plain
ZeRO-3 and is compared exactly: hpZ gathers the same values from another group, a hierarchical gather puts
the same pieces in the same places, MiCS_Init partitions as the engine would, and a resumed run continues
from exactly the saved state. Which process group carried each collective comes from the comms logger.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Any

import numpy as np
import pytest
import torch

from dsrun.estimate.inputs import EstimateInputs
from dsrun.estimate.model_states import model_state_bytes
from tests import tolerance as t
from tests.harness.launch import Launch
from tests.harness.models import build_model, flat_named, global_batch, loss_terms, slice_batch
from tests.harness.runs import Case, full_params, reference_run, train_steps, zero3_config

WORLD, STEPS, NAME = 4, 6, "nanogpt"


def config(**zero: Any) -> dict[str, Any]:
    return zero3_config(3, 2, 1, zero=zero)


# Without prefetching each pass's gathers happen inside it, so the forward's and the backward's are counted
# apart; prefetching or not, the arithmetic is the same (tests/integration/test_zero3_parity.py). ``zero_init``
# here: the model is built under ``zero.MiCS_Init``.
MICS = config(mics_shard_size=2)
HPZ = config(zero_hpz_partition_size=2)
CASES = [Case(key, NAME, cfg, worlds=(WORLD,), steps=STEPS, zero_init=zero_init) for key, cfg, zero_init in (
    ("plain", config(stage3_prefetch_bucket_size=0), False),
    ("mics", MICS, False),
    # a shard group of 4 laid over two "nodes" of 2 (LOCAL_WORLD_SIZE=2 for this run): inside, then across
    ("mics_hier", config(mics_shard_size=4, mics_hierarchical_params_gather=True, stage3_prefetch_bucket_size=0),
     False),
    ("hpz", HPZ, False),
    ("hpz_no_prefetch", config(zero_hpz_partition_size=2, stage3_prefetch_bucket_size=0), False),
    ("mics_init", MICS, True),
)]
LOCAL_WORLD_SIZE = {"mics_hier": "2"}


def _groups_of(stats: dict[str, dict[str, Any]], op: str, field: str = "count") -> dict[str, int]:
    return {group: int(s[field]) for group, s in stats.get(op, {}).items()}


def _run(case: Case, rank: int, world: int) -> dict[str, Any]:
    """Train the case; its last step by hand, counting which groups carried the forward's and the backward's
    collectives."""
    import dsrun
    from dsrun import comm
    from dsrun.engine.initialize import initialize

    if case.zero_init:
        comm.init_distributed(verbose=False)
        with dsrun.zero.MiCS_Init(config_dict_or_path=case.config):
            model = build_model(case.model)
    else:
        model = build_model(case.model)
    engine, _, _, _ = initialize(model=model, config=case.config)
    batch_at = lambda step, size: global_batch(case.model, step, size)  # noqa: E731
    losses, _ = train_steps(engine, batch_at, case.steps - 1, rank, world)
    batch = batch_at(case.steps - 1, 2 * world)
    comm.reset_comms_stats()
    loss = engine(slice_batch(batch, rank * 2, rank * 2 + 2))
    forward = comm.get_comms_group_stats()
    comm.reset_comms_stats()
    engine.backward(loss)
    engine.step()
    backward = comm.get_comms_group_stats()
    total = loss.detach().double().reshape(1)
    comm.all_reduce(total)
    losses.append(total.item() / world)
    params = full_params(engine)
    memory = engine.memory_breakdown().as_dict()
    engine.destroy()
    return {"losses": losses, "params": flat_named(params).numpy(), "memory": memory,
            "numels": [p.numel() for p in params.values()],
            "forward": {op: _groups_of(forward, op) for op in forward},
            "backward": {op: _groups_of(backward, op) for op in backward},
            "bytes": {phase: _groups_of(stats, "all_gather", "message_bytes")
                      for phase, stats in (("forward", forward), ("backward", backward))}}


def _resume(cfg: dict[str, Any], rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    """Train 3 steps, save, train 2 more; a fresh engine loads the checkpoint and trains the same 2."""
    import dsrun

    batch_at = lambda step, size: global_batch(NAME, step, size)  # noqa: E731
    engine, _, _, _ = dsrun.initialize(model=build_model(NAME), config=cfg)
    train_steps(engine, batch_at, 3, rank, world)
    engine.save_checkpoint(ckpt_dir, tag="t3")
    saved = dsrun.zero.full_state_dict(engine.module)
    consolidated = None
    if rank == 0:  # zero_to_fp32 rebuilds the full fp32 model from the saved partitions
        from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        fp32 = get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, "t3")
        names = [n for n, _ in engine.module.named_parameters()]
        consolidated = all(torch.equal(fp32[n], saved[n]) for n in names)
    after = lambda step, size: batch_at(step + 3, size)  # noqa: E731
    uninterrupted, _ = train_steps(engine, after, 2, rank, world)
    engine.destroy()
    torch.manual_seed(99)  # the resumed model starts from other values: the checkpoint must bring them
    fresh, _, _, _ = dsrun.initialize(model=build_model(NAME).apply(_scramble), config=cfg)
    fresh.load_checkpoint(ckpt_dir, tag="t3")
    resumed, _ = train_steps(fresh, after, 2, rank, world)
    fresh.destroy()
    return {"uninterrupted": uninterrupted, "resumed": resumed, "consolidated": consolidated}


def _scramble(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters(recurse=False):
            p.add_(torch.randn_like(p))


def suite(rank: int, world: int, ckpt_root: str) -> dict[str, Any]:
    """Rank entry point: every case, then a resume of each of MiCS and hpZ."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out: dict[str, Any] = {}
    for case in CASES:
        saved = os.environ.get("LOCAL_WORLD_SIZE")
        if case.key in LOCAL_WORLD_SIZE:
            os.environ["LOCAL_WORLD_SIZE"] = LOCAL_WORLD_SIZE[case.key]
        try:
            out[case.key] = _run(case, rank, world)
        finally:
            if saved is not None:
                os.environ["LOCAL_WORLD_SIZE"] = saved
    out["rank"] = rank
    for key, cfg in (("mics", MICS), ("hpz", HPZ)):
        out[f"resume/{key}"] = _resume(cfg, rank, world, os.path.join(ckpt_root, key))
    return out


def launches(root) -> dict:
    return {"suite": Launch(suite, WORLD, (str(root),), timeout=900)}


@pytest.fixture(scope="module")
def results(runs) -> list[dict]:
    return runs["suite"]


@functools.lru_cache(maxsize=None)
def spread() -> t.Spread:
    def run(d: torch.dtype, parts: int, reverse: bool) -> dict:
        return reference_run(NAME, STEPS, 2 * WORLD, 0.0, d, parts, reverse)
    return t.spread(run, torch.float32, loss_terms(NAME, 2 * WORLD))


def _shard(rank: int, size: int) -> str:
    first = rank - rank % size
    return ",".join(str(r) for r in range(first, first + size))


def _replicas(rank: int, size: int) -> str:
    return ",".join(str(r) for r in range(rank % size, WORLD, size))


def _elements(numels: list[int], ranks: int) -> int:
    return sum(math.ceil(n / ranks) for n in numels)


def _estimated_parameter_bytes(numels: list[int], **layout: int) -> int:
    """What dsrun's memory estimator predicts for the parameters of one rank."""
    spec = EstimateInputs(total_params=sum(numels), largest_layer_params=max(numels), ranks_per_node=WORLD,
                          zero_stage=3, precision="fp32", device="cpu", **layout)
    return model_state_bytes(spec).device_params


def test_mics_partitions_over_shard_groups_and_matches_zero3(results: list[dict]) -> None:
    """mics_shard_size=2: half the model's parameter bytes per rank, gathers and reduce-scatters inside the
    shard group, one all-reduce across replicas per step; losses as plain ZeRO-3's. The hierarchical
    gather (mics_hierarchical_params_gather, a shard group of 4 over two nodes of 2) runs in two levels."""
    plain, mics = results[0]["plain"], results[0]["mics"]
    t.assert_tracks(mics, plain, spread(), "MiCS vs ZeRO-3", against="run")
    numels = plain["numels"]
    assert all(n % 2 == 0 for n in numels)  # so "half the model" is exact, no padding
    model_bytes = sum(numels) * 4
    assert mics["memory"]["parameters"] * 2 == model_bytes
    assert mics["memory"]["parameters"] == _estimated_parameter_bytes(numels, mics_shard_size=2)
    assert plain["memory"]["parameters"] == _elements(numels, 4) * 4
    for out in results:
        rank = out["rank"]
        shard, replicas = _shard(rank, 2), _replicas(rank, 2)
        for key in ("mics", "mics_init"):
            got = out[key]
            assert set(got["forward"]["all_gather"]) == {shard}
            assert set(got["backward"]["reduce_scatter"]) == {shard}
            assert got["backward"]["all_reduce"] == {replicas: 1}  # once per step, the accumulated shards
        # zero.MiCS_Init partitions the same way: the same run
        assert out["mics_init"]["losses"] == out["mics"]["losses"]
        np.testing.assert_array_equal(out["mics_init"]["params"], out["mics"]["params"])
        hier = out["mics_hier"]
        local, across = _shard(rank, 2), _replicas(rank, 2)
        gathers = hier["forward"]["all_gather"]
        assert set(gathers) == {local, across} and gathers[local] == gathers[across]
        assert set(hier["backward"]["all_gather"]) == {local, across}
        assert hier["losses"] == out["plain"]["losses"]
        np.testing.assert_array_equal(hier["params"], out["plain"]["params"])


def test_hpz_backward_gathers_stay_in_the_secondary_group(results: list[dict]) -> None:
    """zero_hpz_partition_size=2: the forward gathers over all 4 ranks, every backward gather inside the
    rank's group of 2; each rank holds the secondary partition on top; the losses are plain ZeRO-3's."""
    numels = results[0]["plain"]["numels"]
    for out in results:
        rank, secondary, world = out["rank"], _shard(out["rank"], 2), ",".join(map(str, range(WORLD)))
        hpz, plain = out["hpz_no_prefetch"], out["plain"]
        assert set(hpz["forward"]["all_gather"]) == {world}
        assert hpz["backward"]["all_gather"] == {secondary: plain["backward"]["all_gather"][world]}
        assert hpz["forward"]["all_gather"][world] == plain["forward"]["all_gather"][world]
        # with prefetching, gathers for backward start early: still all from the secondary partitions (bytes: a
        # prefetch bucket's gathers are coalesced across modules, so their count differs)
        prefetched, unprefetched = out["hpz"]["bytes"], hpz["bytes"]
        moved = {g: sum(prefetched[phase].get(g, 0) for phase in ("forward", "backward")) for g in (world, secondary)}
        assert moved == {world: unprefetched["forward"][world], secondary: unprefetched["backward"][secondary]}
        for key in ("hpz", "hpz_no_prefetch"):
            assert out[key]["memory"]["parameters"] == (_elements(numels, 4) + _elements(numels, 2)) * 4
            assert out[key]["memory"]["parameters"] == _estimated_parameter_bytes(numels, hpz_partition_size=2)
            assert out[key]["losses"] == plain["losses"], rank
            np.testing.assert_array_equal(out[key]["params"], plain["params"])


def test_mics_and_hpz_checkpoints_resume(results: list[dict]) -> None:
    """Saved under MiCS (mics_shard_size=2) or hpZ (zero_hpz_partition_size=2) and loaded into the same
    layout, training continues exactly as without the interruption; zero_to_fp32 rebuilds the saved model."""
    for out in results:
        for key in ("resume/mics", "resume/hpz"):
            assert out[key]["resumed"] == out[key]["uninterrupted"], key
    assert results[0]["resume/mics"]["consolidated"] is True
    assert results[0]["resume/hpz"]["consolidated"] is True
