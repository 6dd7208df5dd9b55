"""``engine.save_16bit_model``: the model's weights in its training dtype, one file, for inference or
fine-tuning elsewhere (``torch.load`` + ``load_state_dict``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dsrun import comm

from . import atomic, state


def save_16bit_model(engine: Any, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """Rank 0 writes ``save_dir/save_filename`` (atomically); every rank must call it. Under ZeRO-3 the
    weights are gathered, and nothing is written (returns False) unless
    ``stage3_gather_16bit_weights_on_model_save`` is on, as in DeepSpeed."""
    strategy = engine.strategy
    if strategy is not None and hasattr(strategy, "consolidated_16bit_state_dict"):
        state_dict = strategy.consolidated_16bit_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        if state_dict is None:
            if engine.global_rank == 0:
                print("[dsrun] warning: save_16bit_model did nothing: under ZeRO-3 set "
                      "zero_optimization.stage3_gather_16bit_weights_on_model_save=true", flush=True)
            return False
        state_dict = _retie(engine, state_dict)
    else:
        state_dict = state.module_state_cpu(engine.module, exclude_frozen_parameters) if engine.global_rank == 0 else None
    if engine.global_rank == 0:
        path = Path(save_dir)
        path.mkdir(parents=True, exist_ok=True)
        atomic.save_torch(state_dict, path / save_filename)
    comm.barrier()
    return True


def _retie(engine: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Make tied aliases one tensor again, so the file stores them once."""
    for alias, source in state.shared_params(engine.module).items():
        if alias in state_dict and source in state_dict:
            state_dict[alias] = state_dict[source]
    return state_dict
