"""Rank entry points for the parameter-offload tests (``offload_param`` cpu | nvme at ZeRO stage 3).

Every case trains the tiny tied-embedding GPT of the ZeRO-3 tests with the same data; the reference is the
same run without offload. All cases of one world size run in one launch (:func:`offload_suite`) to keep CI
short. :func:`rss_run` measures a rank's resident memory for the memory test.
"""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from tests.harness.models import build_model, flat_named, global_batch
from tests.harness.runs import full_params, train_steps
from tests.harness.runs import zero3_config as ds_config

STEPS = 5


def nvme(root: str, **extra: Any) -> dict[str, Any]:
    """An NVMe ``offload_param`` section with a pool small enough that shards are evicted and read again."""
    return {"device": "nvme", "nvme_path": root, "buffer_count": 3, "buffer_size": 4096, "max_in_cpu": 0,
            **extra}


def suite_cases(root: str) -> dict[str, tuple[dict[str, Any], bool]]:
    """case -> (ds config, build under zero.Init)."""
    bf16 = {"bf16": {"enabled": True}}
    return {
        "ref": (ds_config(3, 2, 1), False),
        "cpu": (ds_config(3, 2, 1, zero={"offload_param": {"device": "cpu", "pin_memory": True}}), False),
        "nvme": (ds_config(3, 2, 1, zero={"offload_param": nvme(root)}), False),
        # every shard cached in host memory after its first read; prefetch off
        "nvme_cached": (ds_config(3, 2, 1, zero={"offload_param": nvme(root, max_in_cpu=10**9),
                                                     "stage3_prefetch_bucket_size": 0}), False),
        "nvme_init": (ds_config(3, 2, 1, zero={"offload_param": nvme(root)}), True),
        "bf16_ref": (ds_config(3, 2, 1, **bf16), False),
        "bf16_nvme": (ds_config(3, 2, 1, zero={"offload_param": nvme(root)}, **bf16), False),
        # with optimizer offload (dsrun/offload/shard_store.py) as well: ZeRO-Offload / ZeRO-Infinity
        "both_cpu": (ds_config(3, 2, 1, zero={"offload_param": {"device": "cpu"},
                                                  "offload_optimizer": {"device": "cpu"}}), False),
        # the CPU optimizer steps 3000-element tiles: shards that straddle two tiles are written in parts
        "opt_cpu_param_nvme": (ds_config(3, 2, 1, zero={"offload_param": nvme(root), "sub_group_size": 3000,
                                                            "offload_optimizer": {"device": "cpu"}}), False),
        "both_nvme": (ds_config(3, 2, 1, zero={"offload_param": nvme(root), **_nvme_optimizer(root)}), True),
        "both_nvme_bf16": (ds_config(3, 2, 1, zero={"offload_param": nvme(root), **_nvme_optimizer(root)},
                                        **bf16), True),
    }


def _nvme_optimizer(root: str) -> dict[str, Any]:
    return {"sub_group_size": 3000,
            "offload_optimizer": {"device": "nvme", "nvme_path": root, "buffer_count": 12}}


def _build(cfg: dict[str, Any], zero_init: bool) -> Any:
    import dsrun
    from dsrun import comm

    comm.init_distributed(verbose=False)
    if zero_init:
        with dsrun.zero.Init(config_dict_or_path=cfg):
            model = build_model("nanogpt")
    else:
        model = build_model("nanogpt")
    engine, _, _, _ = dsrun.initialize(model=model, config=cfg)
    return engine


def _batch(step: int, size: int) -> Any:
    return global_batch("nanogpt", step, size)


def _params(engine: Any) -> Any:
    return flat_named(full_params(engine)).numpy()


def offload_suite(rank: int, world: int, root: str, ckpt_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (cfg, zero_init) in suite_cases(root).items():
        engine = _build(cfg, zero_init)
        losses, _ = train_steps(engine, _batch, STEPS, rank, world)
        offload = engine.strategy.param_offload
        out[name] = {"losses": losses, "params": _params(engine), "memory": engine.memory_breakdown().as_dict(),
                     "stats": offload.stats() if hasattr(offload, "stats") else None,
                     "device": offload.device if offload is not None else None}
        _close(engine)
    out["ckpt"] = checkpoint_round_trip(rank, world, root, ckpt_dir)
    out["leftover"] = sorted(str(p) for p in Path(root).rglob("*.swp"))
    return out


def checkpoint_round_trip(rank: int, world: int, root: str, ckpt_dir: str) -> dict[str, list[float]]:
    """Train 3 steps with NVMe parameter offload, save, train 2 more; then a fresh offloaded engine and a
    fresh in-memory one load the checkpoint and train the same 2 steps."""
    cfg = ds_config(3, 2, 1, zero={"offload_param": nvme(root)})
    first = _build(cfg, zero_init=True)
    train_steps(first, _batch, 3, rank, world)
    first.save_checkpoint(ckpt_dir, tag="ckpt")
    later = lambda step, size: _batch(step + 3, size)  # noqa: E731
    cont, _ = train_steps(first, later, 2, rank, world)
    _close(first)
    results = {"continued": cont}
    for name, config in (("loaded_nvme", cfg), ("loaded_plain", ds_config(3, 2, 1))):
        engine = _build(config, zero_init=False)
        engine.load_checkpoint(ckpt_dir, tag="ckpt")
        results[name], _ = train_steps(engine, later, 2, rank, world)
        _close(engine)
    return results


def _close(engine: Any) -> None:
    """Remove this engine's swap files now (they would otherwise go when the process exits)."""
    engine.destroy()


# --- resident memory ------------------------------------------------------------------------------------
RSS_GPT = dict(vocab_size=256, block_size=32, n_layer=16, n_head=8, n_embd=512)


def rss_run(rank: int, world: int, offload: dict[str, Any] | None, root: str) -> dict[str, Any]:
    """Build a 50M-parameter bf16 GPT under zero.Init, train 2 steps; return this rank's RSS afterwards.
    ``offload``: keys added to ``zero_optimization`` (None: everything in memory).

    The in-memory run opens an (unused) swap store too, so both processes load the async I/O library and
    start its threads: the difference between them is where the shards live, not the cost of the library."""
    import psutil

    import dsrun
    from dsrun.models.gpt import GPT
    from dsrun.offload.swap_store import SwapStore
    from dsrun.zero import host_memory

    idle_store = SwapStore(root, rank=rank) if offload is None else None

    zero = {"stage": 3, "stage3_param_persistence_threshold": 10_000, "reduce_bucket_size": 1_000_000,
            "sub_group_size": 1_000_000}
    if offload is not None:
        zero.update(offload)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero,
           "steps_per_print": 1000}
    dsrun.comm.init_distributed(verbose=False)
    torch.manual_seed(0)
    with dsrun.zero.Init(config_dict_or_path=cfg):
        model = GPT(**RSS_GPT)
    engine, _, _, _ = dsrun.initialize(model=model, config=cfg)

    def batch(step: int, size: int) -> Any:
        tokens = torch.randint(0, 256, (size, 17), generator=torch.Generator().manual_seed(step))
        return (tokens[:, :-1], tokens[:, 1:])

    losses, _ = train_steps(engine, batch, 2, rank, world)
    engine.empty_partition_cache()
    gc.collect()
    host_memory.trim()
    owner = engine.strategy.param_offload
    placement = getattr(engine.strategy, "placement", None)  # stage 3: the stores of its sub-groups
    swapped = getattr(placement and placement.offloaded, "swapped", None)  # NVMe optimizer offload (masters and states)
    result = {"rss": psutil.Process().memory_info().rss, "losses": losses,
              "offloaded": owner.offloaded_bytes() if owner is not None else 0,
              "pool": owner.buffer_bytes() if owner is not None else 0,
              "optimizer_swapped": swapped.swapped_bytes if swapped is not None else 0,
              "optimizer_pool": swapped.resident_bytes if swapped is not None else 0}
    _close(engine)
    if idle_store is not None:
        idle_store.close()
    return result
