"""Rank entry points for the MiCS and hpZ tests (importable by spawned ranks): one launch of 4 ranks trains
the ZeRO-3 GPT plainly, with MiCS (shard groups of 2, flat and hierarchical), with MiCS built under
``zero.MiCS_Init`` and with hpZ (secondary groups of 2), counts which process groups carried the
collectives, and resumes each of MiCS and hpZ from a checkpoint."""
from __future__ import annotations

import os
from typing import Any

import torch

from tests.harness.models import build_model, flat_named, global_batch, slice_batch
from tests.harness.runs import full_params, train_steps
from tests.harness.runs import zero3_config as ds_config

STEPS = 6
NAME = "nanogpt"


def config(**zero: Any) -> dict[str, Any]:
    return ds_config(3, 2, 1, zero=zero)


# Without prefetching each pass's gathers happen inside it, so the forward's and the backward's are counted
# apart; prefetching or not, the arithmetic is the same (tests/integration/test_zero3_parity.py).
CASES: dict[str, dict[str, Any]] = {
    "plain": config(stage3_prefetch_bucket_size=0),
    "mics": config(mics_shard_size=2),
    # a shard group of 4 laid over two "nodes" of 2 (LOCAL_WORLD_SIZE=2 for this run): inside, then across
    "mics_hier": config(mics_shard_size=4, mics_hierarchical_params_gather=True, stage3_prefetch_bucket_size=0),
    "hpz": config(zero_hpz_partition_size=2),
    "hpz_no_prefetch": config(zero_hpz_partition_size=2, stage3_prefetch_bucket_size=0),
}


def _groups_of(stats: dict[str, dict[str, Any]], op: str) -> dict[str, int]:
    return {group: int(s["count"]) for group, s in stats.get(op, {}).items()}


def _run(cfg: dict[str, Any], rank: int, world: int, zero_init: bool = False) -> dict[str, Any]:
    import dsrun
    from dsrun import comm
    from dsrun.engine.initialize import initialize

    if zero_init:
        comm.init_distributed(verbose=False)
        with dsrun.zero.MiCS_Init(config_dict_or_path=cfg):
            model = build_model(NAME)
    else:
        model = build_model(NAME)
    engine, _, _, _ = initialize(model=model, config=cfg)
    batch_at = lambda step, size: global_batch(NAME, step, size)  # noqa: E731
    losses, _ = train_steps(engine, batch_at, STEPS - 1, rank, world)
    # the last step by hand, counting which groups carried the forward's and the backward's collectives
    batch = batch_at(STEPS - 1, 2 * world)
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
            "backward": {op: _groups_of(backward, op) for op in backward}}


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
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out: dict[str, Any] = {}
    for key, cfg in CASES.items():
        saved = os.environ.get("LOCAL_WORLD_SIZE")
        if key == "mics_hier":
            os.environ["LOCAL_WORLD_SIZE"] = "2"
        try:
            out[key] = _run(cfg, rank, world)
        finally:
            if saved is not None:
                os.environ["LOCAL_WORLD_SIZE"] = saved
    out["mics_init"] = _run(CASES["mics"], rank, world, zero_init=True)
    out["rank"] = rank
    for key in ("mics", "hpz"):
        out[f"resume/{key}"] = _resume(CASES[key], rank, world, os.path.join(ckpt_root, key))
    return out
