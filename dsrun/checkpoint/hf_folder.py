"""A Hugging Face model folder, as ``save_pretrained(OUT, max_shard_size=...)`` writes it, which
``AutoModelForCausalLM.from_pretrained(OUT)`` loads.

``OUT/config.json`` (``generation_config.json`` when given), and the weights: ``model.safetensors``, or past
``max_shard_size`` the shards ``model-00001-of-0000N.safetensors`` ... and their index
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``). Keys
fill a shard in order until the next would pass the size, a larger tensor alone in its own
(:func:`dsrun.utils.zero_to_fp32.split_into_shards`, huggingface_hub's rule). Each file appears only when
complete (written under a temporary name, then renamed); weight files of an earlier export into the same
folder that this one does not write are removed, as ``save_pretrained`` does, so the folder never mixes two.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping

import torch

from dsrun.utils.zero_to_fp32 import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, split_into_shards

from . import atomic

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"


def _json(data: Mapping[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(dict(tensors), str(tmp), metadata={"format": "pt"})  # transformers reads only "pt"-format files
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _is_weight_file(name: str) -> bool:
    return name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME) or (
        name.startswith("model-") and name.endswith(".safetensors") and "-of-" in name)


def write_pretrained(out: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                     generation_config: Mapping[str, Any] | None = None,
                     max_shard_size: int | str = "5GB") -> list[str]:
    """Write the folder ``out`` (created if needed); returns the names of the weight files written. A tensor
    sharing its storage with one written before it is written as its own copy (safetensors stores no
    aliases; a tie belongs in the config's ``tie_word_embeddings``)."""
    out.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    independent: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage().data_ptr()
        independent[name] = (tensor.clone() if storage in seen else tensor).detach().cpu().contiguous()
        seen.add(storage)
    files, total = split_into_shards(independent, SAFE_WEIGHTS_NAME, max_shard_size)
    for name in sorted(os.listdir(out)):
        if _is_weight_file(name) and name not in files:
            os.remove(out / name)  # a previous export's shards: the index written below must be the only one
    for name, keys in files.items():
        _save_safetensors(OrderedDict((key, independent[key]) for key in keys), out / name)
    if len(files) > 1:
        weight_map = {key: name for name, keys in files.items() for key in keys}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic.write_text(out / SAFE_WEIGHTS_INDEX_NAME, _json(index))
    atomic.write_text(out / CONFIG_NAME, _json(config))
    if generation_config is not None:
        atomic.write_text(out / GENERATION_CONFIG_NAME, _json(generation_config))
    atomic.fsync_dir(out)
    return list(files)
