"""``engine.save_16bit_model``: the model's weights in its training dtype, one file, for inference or
fine-tuning elsewhere (``torch.load`` + ``load_state_dict``)."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from dsrun import comm

from . import atomic, state


class _Strategy(Protocol):
    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any] | None: ...

    def full_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any]: ...


class _Engine(Protocol):
    """What a 16-bit export reads of the engine."""

    @property
    def strategy(self) -> _Strategy | None: ...

    @property
    def module(self) -> torch.nn.Module: ...

    @property
    def global_rank(self) -> int: ...


def save_16bit_model(engine: _Engine, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """Rank 0 writes ``save_dir/save_filename`` (atomically); every rank must call it. Under ZeRO-3 the
    weights are gathered (the strategy's ``consolidated_16bit_state_dict``), and nothing is written (returns
    False) unless ``stage3_gather_16bit_weights_on_model_save`` is on, as in DeepSpeed. Tensors are copied
    out of the flat training buffers, so the file holds only the weights, and a tied weight is stored once."""
    holder = _weights_holder(engine)
    if holder is not None:
        state_dict = holder.consolidated_16bit_state_dict(exclude_frozen_parameters)
    else:
        state_dict = state.module_state_cpu(engine.module, exclude_frozen_parameters)
    if state_dict is None:
        if engine.global_rank == 0:
            warnings.warn("save_16bit_model: nothing saved; under ZeRO-3 set "
                          "zero_optimization.stage3_gather_16bit_weights_on_model_save to true")
        return False
    if engine.global_rank == 0:
        path = Path(save_dir)
        path.mkdir(parents=True, exist_ok=True)
        atomic.save_torch(_independent_cpu_copy(engine, state_dict), path / save_filename)
    comm.barrier()
    return True


def consolidated_16bit_state_dict(engine: _Engine, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
    """DeepSpeed's ``engine._zero3_consolidated_16bit_state_dict()``: the full weights as independent CPU tensors
    on global rank 0, an empty dict on the other ranks. Collective: every rank must call it. As in DeepSpeed it
    gathers whatever ``stage3_gather_16bit_weights_on_model_save`` says: accelerate's ``get_state_dict`` checks
    the flag itself, and the Trainer saves a PEFT model's adapters under ZeRO-3 through this call
    (``exclude_frozen_parameters=True``) with the flag off too."""
    holder = _weights_holder(engine)
    if holder is not None:
        state_dict = holder.full_16bit_state_dict(exclude_frozen_parameters)
    else:
        state_dict = state.module_state_cpu(engine.module, exclude_frozen_parameters)
    return _independent_cpu_copy(engine, state_dict) if engine.global_rank == 0 else {}


def _weights_holder(engine: _Engine) -> _Strategy | None:
    """What gathers the weights: the ZeRO strategy, or at stage 3 without an optimizer the engine's
    ``parameter_offload`` (ZeRO-Inference); None: the module holds them whole."""
    return engine.strategy if engine.strategy is not None else getattr(engine, "parameter_offload", None)


def _independent_cpu_copy(engine: _Engine, state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each tensor cloned to CPU once (views of one flat buffer would drag the whole buffer into the file);
    tied aliases point at their source's copy."""
    copies: dict[int, torch.Tensor] = {}
    out = {}
    for name, value in state_dict.items():
        key = id(value)
        if key not in copies:
            copies[key] = value.detach().to("cpu", copy=True)
        out[name] = copies[key]
    for alias, source in state.shared_params(engine.module).items():
        if alias in out and source in out:
            out[alias] = out[source]
    return out
