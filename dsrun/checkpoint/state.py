"""What a checkpoint records about a live engine beyond the ZeRO strategy's own state (which the strategy
gives: its state dict, its named parameter shapes, its file layout): tied-weight aliases, buffers, frozen
parameters, and each rank's RNG states.

Everything returned here is made of tensors, containers, numbers and strings, so it loads back with
``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import json
import random
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import torch



def shared_params(module: torch.nn.Module) -> dict[str, str]:
    """``{alias: source}`` for every state-dict key whose parameter is registered under an earlier name."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.nn.Parameter):
            continue
        if id(value) in first:
            aliases[name] = first[id(value)]
        else:
            first[id(value)] = name
    return aliases


def buffer_names(module: torch.nn.Module) -> list[str]:
    persistent = set(module.state_dict().keys())
    return [name for name, _ in module.named_buffers() if name in persistent]


def module_state_cpu(module: torch.nn.Module, exclude_frozen_parameters: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """The module's state dict as independent CPU tensors (no shared flat storage, so the file holds only
    these elements). Tied aliases stay one tensor. A ZeRO-3 parameter kept whole (``ds_whole``: a partition group
    of one) is saved as the empty placeholder of a partitioned one: the ZeRO-3 layout holds its values in the
    fp32 flat groups, whatever the world size."""
    cloned: dict[int, torch.Tensor] = {}
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for name, value in module.state_dict(keep_vars=True).items():
        if exclude_frozen_parameters and isinstance(value, torch.nn.Parameter) and not value.requires_grad:
            continue
        if id(value) not in cloned:
            whole = getattr(value, "ds_whole", False)
            cloned[id(value)] = torch.empty(0, dtype=value.dtype) if whole else value.detach().to("cpu", copy=True)
        out[name] = cloned[id(value)]
    return out


def frozen_params(module: torch.nn.Module, shard_of: Callable[[torch.nn.Parameter], torch.Tensor] | None = None
                  ) -> tuple[dict[str, torch.Size], dict[str, torch.Tensor]]:
    """Stage 3: shapes and this rank's shards of parameters that do not train. ``shard_of(p)`` reads a
    partitioned parameter's shard wherever it lives (the strategy passes its own; default ``p.ds_tensor``)."""
    shapes, fragments = OrderedDict(), OrderedDict()
    for name, p in module.named_parameters():
        if not p.requires_grad:
            shapes[name] = torch.Size(getattr(p, "ds_shape", p.shape))
            if hasattr(p, "ds_tensor"):
                shard = shard_of(p) if shard_of is not None else p.ds_tensor
            else:
                shard = p.data
            fragments[name] = shard.detach().reshape(-1).to("cpu", copy=True)
    return shapes, fragments


def plain_config(engine: object) -> dict[str, Any]:
    """The DeepSpeed config as plain JSON-able data (read from any engine's ``config`` or ``_config``, if it has one)."""
    raw = getattr(engine, "config", None)
    if isinstance(raw, dict):
        return json.loads(json.dumps(raw, default=str))
    config = getattr(engine, "_config", None)
    if hasattr(config, "model_dump"):
        return json.loads(json.dumps(config.model_dump(mode="json", by_alias=True), default=str))
    return {"source": str(raw)}


# --- RNG states -------------------------------------------------------------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """torch (CPU and CUDA), numpy and Python RNG states, as tensors and tuples."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    np.random.set_state((npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
