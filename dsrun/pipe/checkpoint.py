"""Pipeline checkpoints in DeepSpeed's per-layer layout, loadable at another number of stages.

```
save_dir/global_step<N>/
├── layer_00-model_states.pt                  one file per layer, its state dict (global index; with a
├── layer_01-model_states.pt                  model axis: layer_01-model_00-model_states.pt)
├── mp_rank_00_model_states.pt                per stage (x model rank): module=None, scheduler, counters,
├── mp_rank_01_model_states.pt                param_shapes of the stage's ZeRO masters, the partition
├── zero_pp_rank_<d>_mp_rank_<s>_optim_states.pt   ZeRO-1/2 optimizer state per stage and data rank
└── rng_states_rank_<r>.pt
```
Layer files are written by data-parallel rank 0 of each stage, or spread over the data-parallel ranks with
``checkpoint.parallel_write.pipeline_stage``. A tied layer's file holds the shared module's state at every
index where it appears. Parameter names (``"3.weight"``, ``"tied_modules.embed.weight"``) do not depend on
the number of stages, so loading at another count reads each local layer's file and, for the optimizer,
merges every saved stage's ZeRO state into one full state by name (:mod:`dsrun.checkpoint.reshard`) and
cuts it for this stage. The save goes through the same staged, atomic protocol as every dsrun checkpoint.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import torch
from torch import nn

from dsrun import comm
from dsrun.checkpoint import (atomic, engine_io, layout, partial_state, pipeline_state, reshard, state,
                              universal_checkpoint)
from dsrun.checkpoint.safe_load import load_file
from dsrun.checkpoint.utils import clone_tensors_for_torch_save
from dsrun.ops.cpu_optimizer import adopting_loaded_state
from dsrun.utils.errors import Problem, UserError

from dsrun.pipe.feature import PipelineFeature, expert_parallel_sizes, tied_layers
from dsrun.pipe.partition import partition_uniform

if TYPE_CHECKING:
    from dsrun.config import DSConfig
    from dsrun.zero.base import ZeroStrategy

    from .topology import PipelineParallelGrid

PIPELINE_KEY = pipeline_state.PIPELINE_KEY
_tied_layers = tied_layers  # each tied key's layer indices (the feature records them in the stage layout)


class PipelineLayers(Protocol):
    """What a pipeline checkpoint reads of the :class:`~.module.PipelineModule` (a Protocol: the module
    imports the engine, which imports this module)."""

    num_stages: int
    parts: list[int]
    virtual_stages: int
    _num_layers: int

    def local_layer_indices(self) -> list[int]: ...

    def layer_state_module(self, layer_idx: int) -> nn.Module | None: ...

    def tied_key_of(self, layer_idx: int) -> str | None: ...

    def layers_of_key(self, key: str) -> list[int]: ...

    def _layer_file(self, ckpt_dir: str, layer_idx: int) -> str: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...


class PipelineCheckpointEngine(Protocol):
    """What a pipeline checkpoint reads of the :class:`~.engine.PipelineEngine` (it hands the engine on to
    :mod:`dsrun.checkpoint.engine_io` for the parts every engine shares)."""

    module: PipelineLayers
    grid: PipelineParallelGrid
    pipeline: PipelineFeature  # the pipeline's feature: its checkpoint entries (the stage layout)
    strategy: ZeroStrategy | None
    global_rank: int
    dp_world_size: int
    _config: DSConfig
    last_checkpoint_files: list[str]

    def bfloat16_enabled(self) -> bool: ...


def _slice_rank(engine: PipelineCheckpointEngine) -> int:
    return engine.grid.get_slice_parallel_rank()


def _layers_to_write(engine: PipelineCheckpointEngine) -> list[int]:
    """The local layers this data-parallel rank writes (all on rank 0, or its share with parallel_write)."""
    local = engine.module.local_layer_indices()
    dp_rank, dp_size = engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size()
    if engine._config.checkpoint.parallel_write.pipeline_stage:
        parts = partition_uniform(len(local), dp_size)
        return local[parts[dp_rank]:parts[dp_rank + 1]]
    return local if dp_rank == 0 else []


def _check_moe_save(engine: PipelineCheckpointEngine, moe: dict[str, int]) -> None:
    """Expert-parallel MoE layers keep different experts on each data-parallel rank, but a layer file holds
    one rank's: only ZeRO 1-2's per-rank optimizer files carry every rank's own experts back."""
    if any(ep > 1 for ep in moe.values()) and (engine.strategy is None or engine.strategy.stage not in (1, 2)):
        raise UserError(Problem("zero_optimization.stage", "a pipeline checkpoint of MoE layers with expert "
                                "parallelism (ep_size > 1) needs ZeRO stage 1 or 2 (each rank's experts travel in "
                                "its own optimizer file)", "set zero_optimization.stage to 1 or 2, or ep_size=1"))


def _check_moe_load(engine: PipelineCheckpointEngine, slices: list[dict[str, Any]],
                    load_optimizer_states: bool) -> None:
    """An expert-parallel MoE pipeline checkpoint loads only at the layout that saved it, with its optimizer
    state (see :func:`_check_moe_save`); refused on every rank together (a collective) otherwise."""
    saved = {k: v for sd in slices for k, v in (sd["dsrun"][PIPELINE_KEY].get("moe_ep_sizes") or {}).items()}
    live = expert_parallel_sizes(engine.module)
    own = slices[min(_slice_rank(engine), len(slices) - 1)]
    expert_parallel = any(ep > 1 for ep in [*saved.values(), *live.values()])
    same = (len(slices) == engine.grid.get_slice_parallel_world_size() and engine.strategy is not None
            and int(own.get("dp_world_size", 1)) == engine.dp_world_size
            and int(own["dsrun"]["zero_stage"]) == engine.strategy.stage and load_optimizer_states
            and all(saved.get(name, 1) == ep for name, ep in live.items()))
    refuse = torch.tensor([1.0 if expert_parallel and not same else 0.0])
    comm.all_reduce(refuse, op=comm.ReduceOp.MAX)
    if refuse.item() > 0:
        raise UserError(Problem("load_checkpoint(load_dir=...)", "a pipeline checkpoint of MoE layers with expert "
                                f"parallelism (saved: {len(slices)} stage(s) x {int(own.get('dp_world_size', 1))} "
                                f"data-parallel rank(s), ZeRO stage {int(own['dsrun']['zero_stage'])}) loads only at "
                                "that layout, with the same ep_size and its optimizer state",
                                "load it with the layout that saved it and load_optimizer_states=True"))


def save_pipeline_checkpoint(engine: PipelineCheckpointEngine, save_dir: str, tag: str | int | None = None,
                             client_state: dict | None = None, save_latest: bool = True,
                             exclude_frozen_parameters: bool = False) -> bool:
    module, rank = engine.module, engine.global_rank
    dp_rank = engine.grid.get_data_parallel_rank()
    files = engine_io._layout(engine)
    written: list[str] = []

    moe = expert_parallel_sizes(module)

    def write(staging: Path) -> None:
        _check_moe_save(engine, moe)  # raised here, every rank hears of it and none commits
        for idx in _layers_to_write(engine):
            layer = module.layer_state_module(idx)
            if layer is None:
                continue
            sd = layer.state_dict()
            if exclude_frozen_parameters:
                frozen = {n for n, p in layer.named_parameters() if not p.requires_grad}
                sd = {k: v for k, v in sd.items() if k not in frozen}
            path = Path(module._layer_file(str(staging), idx))
            atomic.save_torch(clone_tensors_for_torch_save(sd), path, rank)
            written.append(path.name)
        if dp_rank == 0:
            # the stage layout (dsrun's "pipeline" entry) and mp_world_size are the pipeline feature's entries
            sd = engine_io.engine_model_states(engine, client_state or {}, exclude_frozen_parameters, files,
                                               with_module=False)
            path = staging / layout.model_states_name(0, 0, mp_rank=_slice_rank(engine))
            atomic.save_torch(sd, path, rank)
            written.append(path.name)
        if engine.strategy is not None and files.optimizer_file_per_rank:
            path = staging / layout.optim_states_name(dp_rank, engine.bfloat16_enabled(), mp_rank=_slice_rank(engine))
            engine_io.save_optimizer_states(engine, path)
            written.append(path.name)
        atomic.save_torch(state.capture_rng_state(), staging / layout.rng_states_name(rank), rank)

    saved = engine_io.save_staged(engine, save_dir, tag, write, save_latest)
    engine.last_checkpoint_files = written
    return saved


# --- load ---------------------------------------------------------------------------------------------------
def _saved_slices(tag_dir: Path) -> list[dict[str, Any]]:
    """Every saved stage's model states (in slice order)."""
    out = pipeline_state.saved_slices(tag_dir)
    if not pipeline_state.is_pipeline_states(out[0]):
        raise UserError(Problem("load_checkpoint(load_dir=...)", f"{tag_dir} holds a non-pipeline checkpoint",
                                "load it into the plain model, convert it with ds_to_universal, or save from a "
                                "pipeline engine"))
    return out


def _load_layers(engine: PipelineCheckpointEngine, tag_dir: Path, strict: bool) -> None:
    module = engine.module
    for idx in module.local_layer_indices():
        layer = module.layer_state_module(idx)
        if layer is None:
            continue
        candidates = [idx]
        key = module.tied_key_of(idx)
        if key is not None:  # any saved copy of a tied module will do
            candidates += [i for i in module.layers_of_key(key) if i != idx]
        path = next((Path(module._layer_file(str(tag_dir), i)) for i in candidates
                     if Path(module._layer_file(str(tag_dir), i)).is_file()), None)
        if path is None:
            if strict and any(True for _ in layer.state_dict()):
                raise FileNotFoundError(f"{tag_dir}: no checkpoint file for layer {idx}")
            continue
        with torch.no_grad():
            layer.load_state_dict(load_file(path), strict=strict)


def _restore_optimizer(engine: PipelineCheckpointEngine, tag_dir: Path, slices: list[dict[str, Any]],
                       load_optimizer_states: bool) -> None:
    strategy = engine.strategy
    dp_rank, live_world = engine.grid.get_data_parallel_rank(), engine.dp_world_size
    live_shapes = strategy.checkpoint_param_shapes()
    if load_optimizer_states:
        own = slices[_slice_rank(engine)] if _slice_rank(engine) < len(slices) else None
        same = (own is not None and len(slices) == engine.grid.get_slice_parallel_world_size()
                and int(own["dsrun"]["zero_stage"]) == strategy.stage and int(own.get("dp_world_size", 1)) == live_world
                and [list(s) for s in (own.get("param_shapes") or [])] == [list(s) for s in live_shapes])
        if same:
            strategy.load_state_dict(pipeline_state.stage_optimizer_states(
                tag_dir, own, _slice_rank(engine), engine.bfloat16_enabled())[dp_rank if strategy.stage else 0])
            return
        # every saved stage's state, this rank's ranges of it read from the files (docs/checkpoint.md)
        # (the masters' sizes only, not a clone of them; the optimizer keeps the cut state: one copy of the share)
        with partial_state.PartialStagesState(tag_dir, slices, engine.bfloat16_enabled()) as source, \
                adopting_loaded_state():
            template = reshard.master_sizes_only(strategy.state_dict())
            strategy.load_state_dict(reshard.state_for_rank(template, source, strategy.stage, live_world, dp_rank,
                                                            live_shapes))
        return
    # the weights just loaded become the masters; the optimizer keeps its state
    full = reshard.FullOptimizerState(fp32={name: p.detach().reshape(-1).float().cpu()
                                            for name, p in engine.module.named_parameters()})
    target = reshard.state_for_rank(strategy.state_dict(), full, strategy.stage, live_world, dp_rank, live_shapes,
                                    load_optimizer_states=load_optimizer_states)
    strategy.load_state_dict(target)


def load_pipeline_checkpoint(engine: PipelineCheckpointEngine, load_dir: str, tag: str | int | None = None,
                             load_module_strict: bool = True, load_optimizer_states: bool = True,
                             load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> tuple[str | None, dict | None]:
    tag_dir = engine_io.find_tag_dir(engine, load_dir, tag)
    if tag_dir is None:
        return None, None
    if universal_checkpoint.is_universal(tag_dir):
        return _load_universal(engine, tag_dir, load_module_strict, load_optimizer_states and not load_module_only,
                               load_lr_scheduler_states, load_module_only)
    slices = _saved_slices(tag_dir)
    own_path = tag_dir / layout.model_states_name(0, 0, mp_rank=min(_slice_rank(engine), len(slices) - 1))
    own = slices[min(_slice_rank(engine), len(slices) - 1)]
    # the pipeline feature checks the saved layout against the module before any layer file is read (the
    # training state's restore hands it the same states again)
    engine.pipeline.load_checkpoint_entries(own)
    if any(sd["dsrun"][PIPELINE_KEY].get("moe_ep_sizes") for sd in slices):  # the same answer on every rank
        _check_moe_load(engine, slices, load_optimizer_states and not load_module_only)
    _load_layers(engine, tag_dir, load_module_strict)
    if engine.strategy is not None:
        _restore_optimizer(engine, tag_dir, slices, load_optimizer_states and not load_module_only)
    if not load_module_only:
        same_layout = (len(slices) == engine.grid.get_slice_parallel_world_size()
                       and int(own.get("dp_world_size", 1)) == engine.dp_world_size)
        engine_io.restore_training_state(engine, own, tag_dir, load_lr_scheduler_states, same_world=same_layout)
    comm.barrier()
    return str(own_path), engine_io.client_state_of(engine, own)


# --- universal checkpoints (parameters by layer name, from a pipeline at any stage count or the dense model) --
def _load_universal(engine: PipelineCheckpointEngine, tag_dir: Path, strict: bool, load_optimizer_states: bool,
                    load_lr_scheduler_states: bool, load_module_only: bool) -> tuple[str, dict]:
    module = engine.module
    names = pipeline_state.NameMap(pipeline_state.first_layers(tied_layers(module)),
                                   getattr(module, "dense_names", None))
    first = names.tied_first
    path = tag_dir / layout.model_states_name(0, 0)
    model_states = load_file(path)
    by_layer = {names.layer(k): v for k, v in model_states["module"].items()}
    for idx in module.local_layer_indices():
        layer = module.layer_state_module(idx)
        if layer is None:
            continue
        key = module.tied_key_of(idx)
        prefix = f"{first[key] if key is not None else idx}."
        sd = {k[len(prefix):]: v for k, v in by_layer.items() if k.startswith(prefix)}
        missing = sorted(set(layer.state_dict()) - set(sd))
        if strict and missing:
            raise UserError(Problem("load_checkpoint(load_dir=...)", f"the universal checkpoint {tag_dir} has no "
                                    f"{[prefix + m for m in missing][:3]} for layer {idx}",
                                    "convert a checkpoint of the same layers (names: docs/checkpoint.md)"))
        with torch.no_grad():
            layer.load_state_dict(sd, strict=strict)
    if engine.strategy is not None:
        strategy = engine.strategy
        layout_of = (strategy.stage, engine.dp_world_size, engine.grid.get_data_parallel_rank(),
                     strategy.checkpoint_param_shapes())
        if load_optimizer_states:  # this rank's ranges of each parameter's files, asked by pipeline name
            with partial_state.PartialUniversalState(tag_dir) as universal, adopting_loaded_state():
                template = reshard.master_sizes_only(strategy.state_dict())
                strategy.load_state_dict(reshard.state_for_rank(
                    template, reshard.RenamedSource(universal, names.universal), *layout_of))
        else:
            full = reshard.FullOptimizerState(fp32={n: p.detach().reshape(-1).float().cpu()
                                                    for n, p in module.named_parameters()})
            strategy.load_state_dict(reshard.state_for_rank(strategy.state_dict(), full, *layout_of,
                                                            load_optimizer_states=False))
    if not load_module_only:
        engine_io.restore_training_state(engine, model_states, tag_dir, load_lr_scheduler_states, same_world=False)
    comm.barrier()
    return str(path), engine_io.client_state_of(engine, model_states)
