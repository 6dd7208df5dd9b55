"""DeepSpeed-Chat's hybrid engine (the ``hybrid_engine`` section): one engine that trains and generates.

RLHF's step 3 alternates generation (the actor answers a batch of prompts) with training on those answers. With
``hybrid_engine.enabled`` :func:`dsrun.initialize` returns a ``DeepSpeedHybridEngine`` (``dsrun/engine/
hybrid_engine.py``) whose ``generate`` (and its module's, as DeepSpeed rebinds it) is
:meth:`HybridEngineFeature.generate`: Hugging Face's own ``generate`` on the training module (dsrun injects no
CUDA kernels here; a token is the same token), arranged the way DeepSpeed's engine arranges it:

* ZeRO-3 with ``pin_parameters`` (the default): every parameter is gathered **once** per ``generate`` call and
  the parameter hooks are lifted for it, so the decode steps run on whole weights; without ``pin_parameters``
  each layer is gathered and released by its hooks at every forward (once per generated token).
* ``inference_tp_size: T`` (ZeRO-3 with ``pin_parameters``): the Transformer blocks' linear pairs are gathered
  ``tp_gather_partition_size`` blocks at a time, each rank keeps its column/row-parallel slice
  (:func:`dsrun.inference.auto_tp.parallel_linears`) and the gathered weights go again; the rest (embeddings,
  norms, the head) stays gathered while generating. The ``T`` ranks of a group (consecutive ranks) generate the
  concatenation of their prompts together and each keeps its own rows.
* ``max_out_tokens``: prompt plus new tokens, as DeepSpeed's workspace holds; the key/value cache is a Hugging
  Face ``StaticCache`` of that many positions, the engine's inference workspace. It stays allocated between
  ``generate`` calls (through training) unless ``release_inference_cache``, which frees it after each call.
* ``enable_cuda_graph``: the decode steps replay CUDA graphs (:mod:`dsrun.inference.decode_graphs`); refused
  where graphs cannot run (a CPU, ZeRO-3, ``release_inference_cache``, ``inference_tp_size > 1``), with the reason.
"""
from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import torch
from torch import nn

from dsrun import comm
from dsrun.accelerator import get_accelerator
from dsrun.features import Feature
from dsrun.inference.auto_tp import (HEAD_ATTRS, KV_HEAD_ATTRS, WIDTH_ATTRS, BlockPlan, attention_modules,
                                     check_split, find_blocks, parallel_linears, split_head_attrs)
from dsrun.inference.decode_graphs import (DecodeGraphCache, decode_steps_from_generate_kwargs,
                                           validate_cuda_graph_support)
from dsrun.inference.groups import TPGroup, model_parallel_group
from dsrun.utils.errors import ConfigError, Problem, UserError
from dsrun.zero.gathered import GatheredParameters
from dsrun.zero.generation import unwrap_model_for_generation
from dsrun.zero.hooks import ParameterCoordinator

if TYPE_CHECKING:
    from dsrun.config import DSConfig
    from dsrun.config.misc import HybridEngineConfig

__all__ = ["HybridEngineFeature"]
_CACHE_KWARGS = ("past_key_values", "cache", "use_cache")


class HybridEngineHost(Protocol):
    """What the feature reads of the engine it attaches to (a ``DeepSpeedHybridEngine``)."""

    module: nn.Module
    strategy: object | None
    mpu: object | None
    device: torch.device


class HybridEngineFeature(Feature):
    """The ``hybrid_engine`` section's generation (see the module's text); attached to a ``DeepSpeedHybridEngine``."""

    name = "hybrid_engine"

    def __init__(self, section: HybridEngineConfig, zero_stage: int):
        self.section, self.zero_stage = section, zero_stage
        self.engine: HybridEngineHost | None = None
        self.tp = TPGroup(None, 0, 1)
        self.plans: list[BlockPlan] = []
        self.graphs: DecodeGraphCache | None = None
        self.workspace: Any = None  # the StaticCache of max_out_tokens positions
        self._workspace_batch: int | None = None
        self._generate: Callable[..., Any] | None = None  # the module's own generate
        # what the last generate did: layers per gather (one entry per gather of blocks), and its latencies
        self.gather_groups: list[int] = []
        self.gather_latency = self.generate_latency = 0.0
        self.total_batch_size: int | None = None

    @classmethod
    def build(cls, config: DSConfig) -> "HybridEngineFeature | None":
        section = config.hybrid_engine
        if not section.enabled:
            changed = sorted(k for k in section.model_fields_set if k != "enabled"
                             and getattr(section, k) != type(section).model_fields[k].default)
            if changed:
                raise ConfigError([Problem(f"hybrid_engine.{k}", "acts only with hybrid_engine.enabled",
                                           "set hybrid_engine.enabled: true, or drop the key") for k in changed])
            return None
        return cls(section, int(config.zero_optimization.stage))

    # --- attach -----------------------------------------------------------------------------------------
    @property
    def z3(self) -> bool:
        coordinator = getattr(getattr(self.engine, "strategy", None), "coordinator", None)
        return self.zero_stage == 3 and isinstance(coordinator, ParameterCoordinator)

    def attach(self, engine: HybridEngineHost) -> None:
        self.engine, section = engine, self.section
        if section.enable_cuda_graph:
            reason = validate_cuda_graph_support(section, self.zero_stage)
            if reason is not None:
                raise ConfigError(Problem("hybrid_engine.enable_cuda_graph", reason,
                                          "set hybrid_engine.enable_cuda_graph: false"))
            self.graphs = DecodeGraphCache(engine.module.forward, max_positions=section.max_out_tokens)
        if section.inference_tp_size > 1:
            self._attach_tensor_parallel(engine)
        # every rank samples alike (DeepSpeed broadcasts rank 0's generator state): a TP group's ranks sample one
        # batch together and must draw the same tokens
        rng = get_accelerator().get_rng_state().to(engine.device)
        if comm.get_world_size() > 1:
            comm.broadcast(rng, 0)
        get_accelerator().set_rng_state(rng.cpu())
        if hasattr(engine.module, "generate"):  # DeepSpeed-Chat calls actor.module.generate
            self._generate = engine.module.generate
            engine.module.generate = self.generate

    def _attach_tensor_parallel(self, engine: HybridEngineHost) -> None:
        size, where = int(self.section.inference_tp_size), "hybrid_engine.inference_tp_size"
        if self.zero_stage != 3 or not self.section.pin_parameters:
            raise ConfigError(Problem(where, f"{size} splits the layers it gathers for generation, which happens "
                                      "only at ZeRO stage 3 with hybrid_engine.pin_parameters (DeepSpeed's rule)",
                                      "use zero_optimization.stage 3 with pin_parameters true, or drop the key"))
        world = comm.get_world_size()
        if world % size:
            raise ConfigError(Problem(where, f"{size} does not divide the world size {world}",
                                      f"launch a multiple of {size} ranks"))
        mpu = engine.mpu if hasattr(engine.mpu, "get_model_parallel_group") else None
        self.tp = model_parallel_group(size, mpu=mpu)
        with GatheredParameters(list(engine.module.parameters())):  # the plan reads the whole weights' shapes
            self.plans = check_split(engine.module, size)

    # --- generate ---------------------------------------------------------------------------------------
    def generate(self, *inputs: torch.Tensor, **kwargs: object) -> Any:
        """The module's ``generate`` with the layout the section asks for (collective at ZeRO-3)."""
        if self._generate is None:
            raise UserError(Problem("hybrid_engine.enabled", f"the {type(self.engine.module).__name__} model has "
                                    "no generate method", "wrap a Hugging Face causal LM"))
        prompt = inputs[0] if inputs else kwargs.get("input_ids")
        if self.total_batch_size is None and torch.is_tensor(prompt):
            self.total_batch_size = prompt.shape[0] * comm.get_world_size()
        self._check_budget(prompt, kwargs)
        start = time.time()
        self.gather_groups = []
        with torch.no_grad():
            if self.z3 and self.section.pin_parameters and self.tp.size > 1:
                out = self._generate_split(start, inputs, kwargs)
            elif self.z3 and self.section.pin_parameters:
                with unwrap_model_for_generation(self.engine):
                    self.gather_groups = [len(self._blocks())]
                    self.gather_latency = time.time() - start
                    out = self._run(inputs, kwargs)
            else:
                if self.z3 and comm.get_world_size() > 1:  # every rank forwards until all are done: hooks gather
                    kwargs.setdefault("synced_gpus", True)
                self.gather_latency = 0.0
                out = self._run(inputs, kwargs)
        if self.section.release_inference_cache:
            self.release_workspace()
        self.generate_latency = time.time() - start - self.gather_latency
        return out

    def _check_budget(self, prompt: object, kwargs: dict[str, Any]) -> None:
        """Prompt plus new tokens must fit ``max_out_tokens`` (DeepSpeed's workspace length)."""
        if not torch.is_tensor(prompt):
            return
        length, limit = prompt.shape[-1], int(self.section.max_out_tokens)
        config = kwargs.get("generation_config") or getattr(self.engine.module, "generation_config", None)
        new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None) if "max_length" not in kwargs
                         else None)
        total = length + int(new) if new is not None else int(kwargs.get("max_length", getattr(config, "max_length",
                                                                                                  0)) or 0)
        if total > limit:
            raise UserError(Problem("hybrid_engine.max_out_tokens", f"a {length}-token prompt and {total - length} "
                                    f"new tokens make {total}, over max_out_tokens={limit}",
                                    "ask for fewer tokens or raise hybrid_engine.max_out_tokens"))

    def _blocks(self) -> list[nn.Module]:
        return [block for _, block in find_blocks(self.engine.module)]

    def _run(self, inputs: tuple, kwargs: dict[str, Any]) -> Any:
        """The module's own generate, with the workspace as its cache and the decode graphs as its forward."""
        if not any(k in kwargs for k in _CACHE_KWARGS) and hasattr(self.engine.module, "config"):
            prompt = inputs[0] if inputs else kwargs.get("input_ids")
            kwargs = {**kwargs, "cache": self._take_workspace(prompt.shape[0])}
        if self.graphs is None:
            return self._generate(*inputs, **kwargs)
        module = self.engine.module
        self.graphs.begin_sequence(decode_steps_from_generate_kwargs(kwargs))
        own = module.__dict__.get("forward")
        module.forward = self.graphs
        try:
            return self._generate(*inputs, **kwargs)
        finally:
            if own is None:
                del module.forward  # the class's forward again
            else:
                module.forward = own

    def _take_workspace(self, batch: int) -> Any:
        """The static key/value cache of ``max_out_tokens`` positions, kept from the last call when the batch is
        the same (reset), else made anew (its tensors are allocated at the first forward)."""
        from transformers import StaticCache

        if self.workspace is None or self._workspace_batch != batch:
            self.release_workspace()
            self.workspace = StaticCache(config=self.engine.module.config, max_cache_len=self.section.max_out_tokens)
            self._workspace_batch = batch
        else:
            self.workspace.reset()
        return self.workspace

    def release_workspace(self) -> None:
        """Free the inference workspace (``release_inference_cache`` does after every generate)."""
        self.workspace, self._workspace_batch = None, None
        if self.graphs is not None:
            self.graphs.invalidate()  # the graphs wrote into the workspace's buffers
        get_accelerator().empty_cache()

    def workspace_bytes(self) -> int:
        """Bytes the inference workspace holds now (0 when released)."""
        if self.workspace is None:
            return 0
        return sum(t.numel() * t.element_size() for layer in self.workspace.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if torch.is_tensor(t))

    # --- tensor-parallel generation ---------------------------------------------------------------------
    def _generate_split(self, start: float, inputs: tuple, kwargs: dict[str, Any]) -> Any:
        partition = int(self.section.tp_gather_partition_size)
        split: list[list[tuple[Any, nn.Module]]] = []
        for first in range(0, len(self.plans), partition):  # one gather per group of blocks, then released
            plans = self.plans[first:first + partition]
            with GatheredParameters([p for plan in plans for p in _pair_params(plan)]):
                split += [[s for pair in plan.pairs for s in parallel_linears(pair, self.tp)] for plan in plans]
            self.gather_groups.append(len(plans))
        self.gather_latency = time.time() - start
        batch = (inputs[0] if inputs else kwargs["input_ids"]).shape[0]
        inputs, kwargs = self._gather_prompts(inputs, kwargs)
        coordinator = self.engine.strategy.coordinator
        with GatheredParameters(self._other_params()), coordinator.unhooked(), self._swapped(split):
            out = self._run(inputs, kwargs)
        del split
        return out[batch * self.tp.rank:batch * (self.tp.rank + 1)]

    def _other_params(self) -> list[nn.Parameter]:
        """The parameters the split does not cut (embeddings, norms, the head)."""
        cut = {id(p) for plan in self.plans for p in _pair_params(plan)}
        return [p for p in self.engine.module.parameters() if id(p) not in cut]

    def _gather_prompts(self, inputs: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """The group's prompts concatenated (each rank's equally long, as DeepSpeed requires), and so their
        attention masks."""
        def gathered(tensor: torch.Tensor) -> torch.Tensor:
            out = torch.empty((tensor.shape[0] * self.tp.size, *tensor.shape[1:]), dtype=tensor.dtype,
                              device=tensor.device)
            comm.all_gather_into_tensor(out, tensor.contiguous(), group=self.tp.group)
            return out

        if inputs:
            inputs = (gathered(inputs[0]), *inputs[1:])
        else:
            kwargs = {**kwargs, "input_ids": gathered(kwargs["input_ids"])}
        if torch.is_tensor(kwargs.get("attention_mask")):
            kwargs = {**kwargs, "attention_mask": gathered(kwargs["attention_mask"])}
        return inputs, kwargs

    @contextmanager
    def _swapped(self, split: list[list[tuple[Any, nn.Module]]]) -> Iterator[None]:
        """The blocks' linears replaced by this rank's slices and their attention's head counts divided; the
        whole modules back on exit."""
        with ExitStack() as undo:
            for plan, slices in zip(self.plans, split):
                for slot, new in slices:
                    setattr(slot.parent, slot.attr, new)
                    undo.callback(setattr, slot.parent, slot.attr, slot.module)
                for module, where in attention_modules(plan):
                    kept = {a: getattr(module, a) for a in HEAD_ATTRS + KV_HEAD_ATTRS + WIDTH_ATTRS
                            if hasattr(module, a)}
                    children = dict(module._modules)
                    undo.callback(_restore, module, kept, children)
                    split_head_attrs(module, self.tp, where)
            yield

    # --- DeepSpeed's engine-side reporting ------------------------------------------------------------------
    def latency_line(self, latency: float, training_latency: float) -> str:
        """DeepSpeed's line at ``eval()``: the time since the last one split into gather, generate and the rest."""
        share = (lambda t: 100 * t / latency) if latency > 0 else (lambda t: 0.0)
        others = latency - self.generate_latency - training_latency
        line = (f"|E2E latency={latency:.2f}s |Gather latency={self.gather_latency:.2f}s "
                f"({share(self.gather_latency):.2f}%) |Generate time={self.generate_latency:.2f}s "
                f"({share(self.generate_latency):.2f}%) |Training time={training_latency:.2f}s "
                f"({share(training_latency):.2f}%) |Others={others:.2f} ({share(others):.2f}%)")
        if self.total_batch_size is not None and latency > 0:
            line += f"|CurSamplesPerSec={self.total_batch_size / latency:.2f} "
        return line

    def metrics(self) -> dict[str, float]:
        return {"gather_latency_s": self.gather_latency, "generate_latency_s": self.generate_latency,
                "workspace_bytes": float(self.workspace_bytes())}

    def close(self) -> None:
        self.release_workspace()
        if self._generate is not None and self.engine is not None:
            self.engine.module.__dict__.pop("generate", None)
            self._generate = None


def _pair_params(plan: BlockPlan) -> list[nn.Parameter]:
    return [p for pair in plan.pairs for slot in (*pair.columns, pair.row) for p in slot.module.parameters()]


def _restore(module: nn.Module, attrs: dict[str, Any], children: dict[str, nn.Module | None]) -> None:
    for attr, value in attrs.items():
        setattr(module, attr, value)
    module._modules.update(children)

