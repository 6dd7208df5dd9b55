"""``clone_tensors_for_torch_save`` and ``get_model_ckpt_name_for_rank`` (DeepSpeed's ``deepspeed.checkpoint.utils``)."""
from __future__ import annotations

import os
from typing import Any

import torch


def clone_tensors_for_torch_save(item: object, device: torch.device | str = torch.device("cpu")) -> Any:
    """A copy of ``item`` (any value) with every tensor (nested in lists, tuples and dicts too) cloned onto
    ``device``.

    ``torch.save`` writes a tensor's whole storage; a parameter that is a view into a flat ZeRO buffer would
    drag the entire buffer into the file. Cloning first stores only the tensor's own elements."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """The model-states file of model-parallel rank ``mp_rank_str`` (``"00"``) in a tag folder:
    ``<base_folder>/mp_rank_00_model_states.pt``, as DeepSpeed names it."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")
