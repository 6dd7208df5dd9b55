"""Where each rank sits and what it holds: its process groups, its ZeRO partitions, its pipeline stage and its
experts, as the engine built them (:func:`describe`).

A real run records every rank's description in the run directory (``topology_rank<R>.json``, written by the
worker after ``initialize``). ``dsrun train --dry-run`` builds the same at the requested world size without
launching a rank (:func:`simulate`): for each rank in turn it starts torch's fake process-group backend (every
collective a no-op, ``FakeStore`` for the store) as that rank, builds the workload's model and
``dsrun.initialize``'s engine, describes it and tears it down. The model is built once per rank, one at a time.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from omegaconf import DictConfig

if TYPE_CHECKING:
    from dsrun.engine.engine import DeepSpeedEngine
    from dsrun.moe.layer import MoE
    from dsrun.zero.base import ZeroStrategy

TOPOLOGY_FILE = "topology_rank{rank}.json"
MONITORS = ("tensorboard", "wandb", "comet", "csv_monitor", "mlflow", "comms_logger")


def describe(engine: DeepSpeedEngine) -> dict[str, Any]:
    """This rank's groups (global ranks of each), ZeRO partition numels (one per optimizer param group, or
    per stage-3 sub-group), pipeline stage (layers ``[start, end)`` per chunk, parameters held) and experts
    (global expert ids held, per MoE layer)."""
    from dsrun.moe.layer import moe_layers
    from dsrun.pipe.module import PipelineModule

    groups, module, strategy = engine.groups, engine.module, engine.strategy
    rank = groups.rank
    info: dict[str, Any] = {"rank": rank, "world_size": groups.world_size,
                            "groups": {axis: groups.members(axis) for axis in ("pipe", "data", "model")}}
    if groups.sequence_parallel_size > 1:
        info["groups"]["sequence"] = groups.sequence_members()
    layers = moe_layers(module)
    for size in sorted({layer.ep_size for layer in layers}):
        info["groups"][f"expert{size}"], info["groups"][f"expert{size}_data"] = groups.expert_members(size)
    if layers:
        info["experts"] = [_experts_held(layer, groups.expert_members(layer.ep_size)[0].index(rank))
                           for layer in layers]
    info["zero"] = {"stage": engine.zero_optimization_stage(), "partition_numels": _partitions(strategy)}
    if isinstance(module, PipelineModule):
        info["pipeline"] = {"stage": module.stage_id,
                            "layers": [list(module.chunk_range(c)) for c in range(module.virtual_stages)],
                            "params": sum(p.numel() for p in module.parameters())}
    return info


def _experts_held(layer: MoE, place: int) -> list[int]:
    local = layer.num_local_experts
    return list(range(place * local, (place + 1) * local))


def _partitions(strategy: ZeroStrategy | None) -> list[int]:
    if strategy is None:
        return []
    if hasattr(strategy, "sub_groups"):  # stage 3: each sub-group holds this rank's shards of its parameters
        return [int(sg.numel) for sg in strategy.sub_groups]
    partitioned = getattr(strategy, "partitioned", True)
    return [int(g.partition_numel if partitioned else g.numel) for g in strategy.groups]


def write(run_dir: Path, info: dict[str, Any]) -> Path:
    path = Path(run_dir) / TOPOLOGY_FILE.format(rank=info["rank"])
    path.write_text(json.dumps(info, indent=1) + "\n")
    return path


def load(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's recorded description, in rank order."""
    found = [json.loads(p.read_text()) for p in Path(run_dir).glob(TOPOLOGY_FILE.format(rank="*"))]
    return sorted(found, key=lambda info: info["rank"])


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int, local_rank: int, local_world_size: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world_size`` on torch's fake backend (no peers, no-op collectives)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import torch

    if torch.cuda.is_available():  # this machine may have fewer GPUs than a launch's host: rank r uses r mod N
        local_rank %= max(1, torch.cuda.device_count())
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
           "LOCAL_WORLD_SIZE": str(local_world_size)}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def simulate(spec: DictConfig, hosts: list[int]) -> list[dict[str, Any]]:
    """:func:`describe` of every rank's engine, built on the fake backend one rank at a time; ``hosts`` holds
    each host's rank count in launch order (monitors and the comms logger off: a dry run writes no metrics)."""
    import warnings

    import torch
    from omegaconf import OmegaConf

    import dsrun

    from . import compose

    ds_config = OmegaConf.to_container(spec.ds, resolve=True)
    for section in MONITORS:
        if isinstance(ds_config.get(section), dict):
            ds_config[section]["enabled"] = False
    world_size = sum(hosts)
    places = [(local, count) for count in hosts for local in range(count)]
    ranks = []
    for rank, (local_rank, local_world_size) in enumerate(places):
        with fake_rank(rank, world_size, local_rank, local_world_size), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"total_num_steps \d+ is less than warmup_num_steps")
            torch.manual_seed(int(spec.train.seed))
            workload = compose(spec, ds_config, world_size)
            model = workload.build_model()
            engine, _, _, _ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
            try:
                ranks.append(describe(engine))
            finally:
                engine.destroy()
    return ranks


def lines(ranks: list[dict[str, Any]]) -> list[str]:
    """Two lines per rank for ``dsrun train --dry-run``: its groups, then what it holds."""
    out = []
    for info in ranks:
        groups = "  ".join(f"{axis} {members}" for axis, members in info["groups"].items())
        out.append(f"rank {info['rank']:<4}  groups: {groups}")
        zero = info["zero"]
        held = [f"ZeRO-{zero['stage']} partition numels {zero['partition_numels']}"]
        if "pipeline" in info:
            pipe = info["pipeline"]
            cut = ", ".join(f"{start}-{end - 1}" for start, end in pipe["layers"] if end > start)
            held.append(f"pipeline stage {pipe['stage']} layers {cut} ({pipe['params']:,} params)")
        if "experts" in info:
            held.append(f"experts {info['experts'][0]} in each of {len(info['experts'])} MoE layers"
                        if all(e == info["experts"][0] for e in info["experts"]) else f"experts {info['experts']}")
        out.append("           holds: " + "; ".join(held))
    return out
