"""Rank entry points for the optimizer-offload tests (importable by spawned ranks)."""
from __future__ import annotations

import os
from typing import Any

import torch

from tests.harness.runs import ds_config, engine_run

STEPS = 8


def offload_section(device: str, nvme_path: str | None = None, **extra: Any) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device, "pin_memory": True, **extra}
    if device == "nvme":
        section["nvme_path"] = nvme_path
        section.setdefault("buffer_count", 12)
    return section


def config(stage: int, offload: dict[str, Any] | None, precision: str = "fp32", sub_group_size: int = 3000,
           gas: int = 1, **extra: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "sub_group_size": sub_group_size}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if offload is not None:
        zero["offload_optimizer"] = offload
    cfg = ds_config(stage, 2, gas, zero_optimization=zero, **extra)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def cases(nvme_path: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (model, config): each offloaded run and the in-memory run it must track."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for stage in (1, 2, 3):
        out[f"base/{stage}"] = ("gpt", config(stage, None))
        out[f"cpu/{stage}"] = ("gpt", config(stage, offload_section("cpu")))
    out["nvme/3"] = ("gpt", config(3, offload_section("nvme", nvme_path)))
    out["nvme_fast/3"] = ("gpt", config(3, offload_section("nvme", nvme_path, fast_init=True, buffer_count=4)))
    out["ratio/3"] = ("gpt", config(3, offload_section("cpu", ratio=0.5)))
    out["base_bf16/3"] = ("gpt", config(3, None, "bf16"))
    out["nvme_bf16/3"] = ("gpt", config(3, offload_section("nvme", nvme_path), "bf16"))
    out["base_bf16/2"] = ("gpt", config(2, None, "bf16"))
    out["cpu_bf16/2"] = ("gpt", config(2, offload_section("cpu"), "bf16"))
    out["base_gas/3"] = ("gpt", config(3, None, gas=2, gradient_clipping=0.05))
    out["nvme_gas/3"] = ("gpt", config(3, offload_section("nvme", nvme_path, buffer_count=5), gas=2,
                                       gradient_clipping=0.05))
    return out


def parity_suite(rank: int, world: int, nvme_path: str, only: list[str] | None = None) -> dict[str, Any]:
    results = {}
    for key, (name, cfg) in cases(nvme_path).items():
        if only and key not in only:
            continue
        results[key] = engine_run(name, cfg, STEPS, rank, world)
    return results


# --- checkpoints ----------------------------------------------------------------------------------------
def nvme_zero(nvme_path: str, **extra: Any) -> dict[str, Any]:
    return {"sub_group_size": 2000,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 12, **extra}}


def checkpoint_jobs(root: str, nvme_path: str) -> list[dict[str, Any]]:
    """Save with NVMe offload / in memory; load each into the other, into stage-2 CPU offload (resharded)."""
    base = dict(stage=3, precision="fp32", global_batch=4, dropout=0.0)
    nvme = dict(base, zero=nvme_zero(nvme_path))
    a, b = f"{root}/nvme", f"{root}/mem"
    return [
        dict(nvme, steps=2, save_at=(2,), save_dir=a),                      # 0: NVMe run saved at step 2
        dict(base, steps=4, save_at=(2,), save_dir=b),                      # 1: in-memory reference, 4 steps
        dict(base, steps=2, load=a),                                        # 2: NVMe -> in memory
        dict(nvme, steps=2, load=b),                                        # 3: in memory -> NVMe
        dict(nvme, steps=2, load=a),                                        # 4: NVMe -> NVMe
        dict(base, stage=2, steps=2, load=a,                                # 5: NVMe stage 3 -> CPU stage 2
             zero={"offload_optimizer": {"device": "cpu"}}),
        dict(base, stage=1, steps=2, save_at=(2,), save_dir=f"{root}/cpu1",  # 6: CPU stage 1 saved at 2
             zero={"offload_optimizer": {"device": "cpu"}}),
        dict(base, stage=1, steps=2, load=f"{root}/cpu1"),                 # 7: CPU stage 1 -> in memory
    ]


# --- resident memory --------------------------------------------------------------------------------------
def resident_memory(rank: int, world: int, nvme_path: str | None, steps: int = 2) -> dict[str, Any]:
    """Train a ~20M-parameter GPT in bf16 at ZeRO-3 (NVMe optimizer offload when ``nvme_path``); this rank's
    RSS (psutil) after the steps, and the bytes its swap files hold."""
    import psutil

    import dsrun
    from dsrun.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=2048, block_size=16, n_layer=6, n_head=8, n_embd=512, dropout=0.0)
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 250_000,
                            "reduce_bucket_size": 500_000, "stage3_prefetch_bucket_size": 500_000}
    if nvme_path:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 12}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero, "steps_per_print": 1000}
    engine, *_ = dsrun.initialize(model=model, config=cfg)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 2048, (2, 17), generator=gen)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    from dsrun.zero import host_memory

    host_memory.trim()
    placement = getattr(engine.strategy, "placement", None)  # stage 3: the stores of its sub-groups
    swapped = getattr(placement and placement.offloaded, "swapped", None)
    return {"rss": psutil.Process().memory_info().rss, "losses": losses,
            "swapped_bytes": swapped.swapped_bytes if swapped is not None else 0,
            "trainable": sum(sg.numel for sg in engine.strategy.sub_groups),
            "memory": engine.memory_breakdown().as_dict()}
