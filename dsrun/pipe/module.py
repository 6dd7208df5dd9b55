"""``PipelineModule``: a model written as a sequence of layers, cut into pipeline stages.

The forward pass is implicitly ``x = layer(x)`` for each layer, with ``x`` one tensor or a tuple of tensors
(a layer receives the tuple as one argument). Every rank knows the whole list of layers; it builds (or keeps)
only those of its own stage, registered under their global index (``"3.weight"``) so parameter names do not
depend on the number of stages. Layers given as :class:`~.spec.TiedLayerSpec` with one ``key`` are one module
per stage, registered as ``tied_modules.<key>``; the stages that share a key form a tie group, the first of
them owns the weights for the optimizer (see :mod:`dsrun.pipe.engine`).

With ``pipeline.schedule: interleaved`` the engine cuts the layers into ``stages x virtual_stages`` chunks
instead (:meth:`PipelineModule.set_virtual_stages`): this rank holds chunks ``stage, stage + stages, ...``.
"""
from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from dsrun import comm
from dsrun.comm import PipeDataParallelTopology, ProcessTopology
from dsrun.activation_checkpointing.checkpoint import checkpoint  # DeepSpeed's default checkpoint function
from dsrun.utils.seeding import set_random_seed
from dsrun.utils.errors import Problem, UserError

from dsrun.pipe.partition import partition_layers
from dsrun.pipe.spec import Activations, LayerSpec, PipeLayer, TiedLayerSpec
from dsrun.pipe.topology import PipelineParallelGrid


class PipelineModule(nn.Module):
    """A sequence of layers partitioned into ``num_stages`` pipeline stages (or the ``pipe`` axis of
    ``topology``); see the module docstring and docs/pipeline.md."""

    def __init__(self, layers: Iterable[PipeLayer], num_stages: int | None = None,
                 topology: ProcessTopology | None = None, loss_fn: Callable | None = None, seed_layers: bool = False,
                 seed_fn: Callable | None = None, base_seed: int = 1234, partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0, activation_checkpoint_func: Callable = checkpoint,
                 checkpointable_layers: list[str] | None = None):
        super().__init__()
        if num_stages is None and topology is None:
            raise RuntimeError("PipelineModule needs num_stages or topology")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError("checkpointable_layers must be a list of layer class names or None")
        if not comm.is_initialized():
            comm.init_distributed(verbose=False)
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.micro_offset = 0
        self.global_rank, self.world_size = comm.get_rank(), comm.get_world_size()
        if topology is None:
            if self.world_size % num_stages:
                raise UserError(Problem("PipelineModule(num_stages=...)", f"{num_stages} stages do not divide the "
                                        f"world of {self.world_size} ranks", "launch a multiple of num_stages ranks"))
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)
        elif num_stages is not None and num_stages != topology.get_dim("pipe"):
            raise UserError(Problem("PipelineModule(num_stages=...)", f"{num_stages} disagrees with the topology's "
                                    f"pipe axis ({topology.get_dim('pipe')})", "pass one of them"))
        self._topo = topology
        self._grid = PipelineParallelGrid(topology=topology)
        self.num_stages = self._grid.pipe_parallel_size
        self.stage_id = self._grid.get_stage_id()
        self._layer_specs = list(layers.children()) if isinstance(layers, nn.Sequential) else list(layers)
        self._num_layers = len(self._layer_specs)
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.tied_comms: dict[str, dict[str, Any]] = {}
        self._built: dict[int, Any] = {}
        self.virtual_stages = 1
        self.parts = partition_layers(self._layer_specs, self.num_stages, partition_method)
        self._place()

    # --- partitioning and building ------------------------------------------------------------------------
    def set_virtual_stages(self, virtual_stages: int) -> None:
        """Re-cut the layers into ``num_stages * virtual_stages`` chunks (the interleaved schedule); this rank
        keeps the layers of chunks ``stage_id + k * num_stages``. Collective (tie groups are rebuilt)."""
        virtual_stages = int(virtual_stages)
        if virtual_stages == self.virtual_stages:
            return
        chunks = self.num_stages * virtual_stages
        if self._num_layers < chunks:
            raise UserError(Problem("pipeline.virtual_stages", f"{virtual_stages} virtual stages x {self.num_stages} "
                                    f"stages need at least {chunks} layers; the model has {self._num_layers}",
                                    "lower pipeline.virtual_stages"))
        self.virtual_stages = virtual_stages
        self.parts = partition_layers(self._layer_specs, chunks, self.partition_method)
        self._place()

    def chunk_range(self, chunk_id: int) -> tuple[int, int]:
        """Global layer indices ``[start, end)`` of this rank's chunk ``chunk_id``."""
        part = chunk_id * self.num_stages + self.stage_id
        return self.parts[part], self.parts[part + 1]

    def stage_of_layer(self, layer_idx: int) -> int:
        """The pipeline stage (rank along ``pipe``) holding global layer ``layer_idx``."""
        for part in range(len(self.parts) - 1):
            if self.parts[part] <= layer_idx < self.parts[part + 1]:
                return part % self.num_stages
        raise IndexError(f"layer {layer_idx} is not in a model of {self._num_layers} layers")

    def local_layer_indices(self) -> list[int]:
        return [i for c in range(self.virtual_stages) for i in range(*self.chunk_range(c))]

    def _place(self) -> None:
        """Build this rank's layers (keeping those it already has), drop the others, and rebuild the tie groups."""
        local = self.local_layer_indices()
        for idx in [i for i in self._built if i not in local]:
            if str(idx) in self._modules:
                delattr(self, str(idx))
            del self._built[idx]
        keys_needed = {self._layer_specs[i].key for i in local if isinstance(self._layer_specs[i], TiedLayerSpec)}
        for key in [k for k in self.tied_modules if k not in keys_needed]:
            del self.tied_modules[key]
        for idx in local:
            if idx not in self._built:
                self._built[idx] = self._build_layer(idx)
        self._index_tied_modules()

    def _build_layer(self, idx: int) -> nn.Module | Callable[..., Any]:
        layer = self._layer_specs[idx]
        if self.seed_layers:
            (self.seed_fn or set_random_seed)(self.base_seed + idx)
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            return partial(layer.forward_fn, module) if layer.forward_fn is not None else module
        if isinstance(layer, LayerSpec):
            layer = layer.build()
        if isinstance(layer, nn.Module):
            self.add_module(str(idx), layer)
            return layer
        if callable(layer):
            return layer
        raise TypeError(f"PipelineModule layer {idx}: {layer!r} is not a module, a LayerSpec or a callable")

    def _tie_stages(self) -> dict[str, list[int]]:
        """For each tied key, the pipeline stages holding a layer with that key."""
        stages: dict[str, set[int]] = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                stages.setdefault(layer.key, set()).add(self.stage_of_layer(idx))
        return {key: sorted(s) for key, s in sorted(stages.items())}

    def _index_tied_modules(self) -> None:
        """One process group per tied key and pipeline (the stages sharing the key, at this rank's data and
        model coordinates), from the grid's :class:`~dsrun.comm.ProcessGroups`, which creates them collectively
        (every rank, in key order) and destroys those of ties this cut no longer has."""
        groups = self._grid.groups
        ties = {key: stages for key, stages in self._tie_stages().items() if len(stages) > 1}
        groups.release_stage_groups(keep=list(ties.items()))
        self.tied_comms = {}
        for key, stages in ties.items():
            mine = groups.stage_group(stages, name=key)
            if mine is not None:
                self.tied_comms[key] = {"ranks": mine.ranks, "group": mine.group, "owner": mine.ranks[0],
                                        "weight_attr": self.tied_weight_attrs.get(key, ["weight"])}

    def tied_parameters(self, owned: bool | None = None) -> list[nn.Parameter]:
        """Parameters tied across stages (``owned``: only those this stage updates, or only those it does not)."""
        params = []
        for key, entry in self.tied_comms.items():
            is_owner = entry["owner"] == self.global_rank
            if owned is None or owned == is_owner:
                params += [getattr(self.tied_modules[key], attr) for attr in entry["weight_attr"]]
        return params

    def allreduce_tied_weight_gradients(self) -> None:
        """All-reduce (sum) the gradients of the tied weights among the stages sharing them."""
        for key, entry in self.tied_comms.items():
            for attr in entry["weight_attr"]:
                weight = getattr(self.tied_modules[key], attr)
                if weight.grad is None:
                    weight.grad = torch.zeros_like(weight)
                comm.all_reduce(weight.grad.data, group=entry["group"])

    def _synchronize_tied_weights(self) -> None:
        """Give every stage sharing a key the owner's weights."""
        with torch.no_grad():
            for key, entry in self.tied_comms.items():
                for attr in entry["weight_attr"]:
                    comm.broadcast(getattr(self.tied_modules[key], attr).data, src=entry["owner"],
                                   group=entry["group"])

    # --- forward ------------------------------------------------------------------------------------------
    def _exec_range(self, start: int, end: int) -> Callable[..., Activations]:
        def run(*inputs: object) -> Activations:
            x = inputs[0] if len(inputs) == 1 else inputs
            for idx in range(start, end):
                if self.seed_layers:  # dropout depends on the micro-batch and the layer, not on the stage count
                    (self.seed_fn or set_random_seed)(self.base_seed * (self.micro_offset + 1) + idx)
                x = self._built[idx](x)
            return x
        return run

    def _is_checkpointable(self, start: int, end: int) -> bool:
        layers = [self._built[i] for i in range(start, end)]
        if self.checkpointable_layers is not None:
            return all(type(layer).__name__ in self.checkpointable_layers for layer in layers)
        return any(isinstance(layer, nn.Module) and any(True for _ in layer.parameters()) for layer in layers)

    def forward(self, forward_input: Activations, chunk_id: int = 0) -> Activations:
        """Run this rank's layers (of chunk ``chunk_id`` with virtual stages) on ``forward_input``."""
        start, end = self.chunk_range(chunk_id)
        interval = self.activation_checkpoint_interval
        if not (interval and self.training and torch.is_grad_enabled()):
            return self._exec_range(start, end)(forward_input)
        x = forward_input
        for first in range(start, end, interval):
            last = min(first + interval, end)
            args = x if isinstance(x, tuple) else (x,)
            carries_grad = any(torch.is_tensor(a) and a.requires_grad for a in args)
            # a range whose inputs carry no gradient (token ids on the first stage) runs as is: a reentrant
            # checkpoint would drop its parameters' gradients
            if self._is_checkpointable(first, last) and carries_grad:
                x = self.activation_checkpoint_func(self._exec_range(first, last), *args)
            else:
                x = self._exec_range(first, last)(*args)
        return x

    # --- DeepSpeed's accessors ----------------------------------------------------------------------------
    @staticmethod
    def engine_class() -> type:
        """The engine :func:`dsrun.initialize` builds for this model."""
        from dsrun.pipe.engine import PipelineEngine

        return PipelineEngine

    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def get_additional_losses(self) -> dict[str, torch.Tensor] | None:
        """Model-specific losses to report besides the main one (none by default)."""
        return None

    # --- per-layer checkpoint files (DeepSpeed's names) ---------------------------------------------------
    def ckpt_prefix(self, checkpoints_path: str, tag: str) -> str:
        """``<path>/<tag>/module`` plus ``-<axis>_<rank:02d>`` for each axis but ``data``."""
        rank_name = "module"
        coord = self._topo.get_coord(self.global_rank)
        for axis in self._topo.get_axis_names():
            if axis != "data":
                rank_name += f"-{axis}_{getattr(coord, axis):02d}"
        return os.path.join(checkpoints_path, str(tag), rank_name)

    def _layer_file(self, ckpt_dir: str, layer_idx: int) -> str:
        rank_repr = self._topo.get_rank_repr(rank=self.global_rank)
        name = f"layer_{layer_idx:02d}" + (f"-{rank_repr}" if rank_repr else "") + "-model_states.pt"
        return os.path.join(ckpt_dir, name)

    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        """The file of this rank's ``local_layer_idx``-th layer: ``layer_XX[-model_YY]-model_states.pt``."""
        return self._layer_file(ckpt_dir, self.local_layer_indices()[local_layer_idx])

    def ckpt_layer_path_list(self, ckpt_dir: str, local_layer_idx: int) -> list[str]:
        """Every saved file of that layer (one per model-parallel rank)."""
        idx = self.local_layer_indices()[local_layer_idx]
        return sorted(str(p) for p in Path(ckpt_dir).glob(f"layer_{idx:02d}-*model_states.pt"))

    def layer_state_module(self, layer_idx: int) -> nn.Module | None:
        """The module whose state a layer's file holds (the tied module for a tied layer; None for a function)."""
        spec = self._layer_specs[layer_idx]
        if isinstance(spec, TiedLayerSpec):
            return self.tied_modules[spec.key]
        layer = self._built[layer_idx]
        return layer if isinstance(layer, nn.Module) else None

    def tied_key_of(self, layer_idx: int) -> str | None:
        spec = self._layer_specs[layer_idx]
        return spec.key if isinstance(spec, TiedLayerSpec) else None

    def layers_of_key(self, key: str) -> list[int]:
        return [i for i, s in enumerate(self._layer_specs) if isinstance(s, TiedLayerSpec) and s.key == key]
