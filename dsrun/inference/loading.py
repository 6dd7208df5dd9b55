"""Weights for inference: a dsrun training checkpoint, a ``save_16bit_model`` file, or DeepSpeed's JSON.

``checkpoint=`` (relative paths under ``base_dir``) may be

- a run directory (its ``checkpoints/``), a checkpoint folder (the one holding ``latest``) or one tag's
  folder: the ZeRO partitions of every rank are gathered into whole fp32 weights, whatever the stage and the
  number of ranks that saved them (:func:`dsrun.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`);
- a state-dict file (``save_16bit_model``'s ``pytorch_model.bin``, ``zero_to_fp32``'s output, a
  ``.safetensors`` file) or a folder holding ``pytorch_model.bin`` / ``model.safetensors``;
  an MoE model's (any ZeRO stage) has its experts' masters from the per-expert files, by global id, whatever
  expert-parallel size saved it;
- DeepSpeed's checkpoint description, as a dict or a ``.json`` file:
  ``{"type": "ds_model", "version": 0.0, "checkpoints": PATH or [FILES of one sharded state dict]}``.

The whole state dict is loaded into the unsplit model first; automatic tensor parallelism then keeps each
rank's slices, so any checkpoint loads at any tensor-parallel size.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from dsrun.utils import zero_to_fp32 as z2f
from dsrun.utils.errors import Problem, UserError

KEY = "init_inference.checkpoint"
STATE_FILES = ("pytorch_model.bin", "model.safetensors", "pytorch_model.pt", "model.pt")


def _user_error(message: str, hint: str = "") -> UserError:
    return UserError(Problem(KEY, message, hint))


def read_state_dict(source: str | dict[str, Any], base_dir: str = "") -> tuple[dict[str, torch.Tensor], str]:
    """The whole state dict named by ``source``, and a short description of where it came from."""
    if isinstance(source, dict):
        return _from_description(source, base_dir)
    path = Path(base_dir) / source if base_dir else Path(source)
    path = path.expanduser()
    if not path.exists():
        raise _user_error(f"no such file or folder: {path}",
                          "pass a run directory, a checkpoint folder or a model file")
    if path.is_file() and path.suffix == ".json":
        try:
            description = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise _user_error(f"{path} is not valid JSON ({err})") from None
        return _from_description(description, str(path.parent) if not base_dir else base_dir)
    if path.is_dir():
        return _from_folder(path)
    return _from_file(path), f"state dict {path}"


def _from_description(description: object, base_dir: str) -> tuple[dict[str, torch.Tensor], str]:
    """The weights a checkpoint description names (any parsed JSON value; a dict of the right keys passes)."""
    if not isinstance(description, dict) or "checkpoints" not in description:
        raise _user_error("a checkpoint description needs 'type' and 'checkpoints'",
                          '{"type": "ds_model", "version": 0.0, "checkpoints": "path"}')
    kind = str(description.get("type", "ds_model"))
    if kind.lower() != "ds_model":
        raise _user_error(f"type {kind!r} is not supported; dsrun loads 'ds_model' checkpoints "
                          "(its own training checkpoints and state-dict files)")
    base = str(description.get("base_dir") or base_dir)
    files = description["checkpoints"]
    if isinstance(files, str):
        return read_state_dict(files, base)
    merged: dict[str, torch.Tensor] = {}
    for name in files:  # the shards of one state dict, each a file
        part, _ = read_state_dict(str(name), base)
        merged.update(part)
    return merged, f"{len(files)} state-dict files"


def _from_folder(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    from dsrun.rundir import RESOLVED_YAML

    if (path / RESOLVED_YAML).is_file() and not (path / z2f.LATEST).is_file():
        checkpoints = path / "checkpoints"
        if not (checkpoints / z2f.LATEST).is_file():
            from dsrun.checkpoint.training import no_checkpoint_reason

            raise _user_error(*no_checkpoint_reason(path))
        path = checkpoints
    if (path / z2f.LATEST).is_file():
        return _zero(path, None), f"training checkpoint {path} (tag {(path / z2f.LATEST).read_text().strip()})"
    if any(path.glob(f"*{z2f.MODEL_SUFFIX}")):
        return _zero(path.parent, path.name), f"training checkpoint {path}"
    for name in STATE_FILES:
        if (path / name).is_file():
            return _from_file(path / name), f"state dict {path / name}"
    raise _user_error(f"{path} holds no checkpoint ('latest', '*{z2f.MODEL_SUFFIX}') and no model file "
                      f"({', '.join(STATE_FILES)})", "pass a run directory, a checkpoint folder or a model file")


def _zero(folder: Path, tag: str | None) -> dict[str, torch.Tensor]:
    try:
        tag_dir = Path(z2f.resolve_tag_dir(str(folder), tag))
        state = dict(z2f.get_fp32_state_dict_from_zero_checkpoint(str(folder), tag))
        if not z2f.has_expert_files(str(tag_dir)) and any(".deepspeed_experts." in name for name in state):
            # an older dsrun's ZeRO-3 kept experts in rank partitions, under each rank's local names
            raise _user_error(f"{tag_dir} is an MoE checkpoint without per-expert files: its experts cannot be "
                              "told apart by global id", "save it again with this dsrun (load it at the topology "
                              "that saved it, then save_checkpoint)")
        return state
    except (ValueError, FileNotFoundError, KeyError) as err:
        raise _user_error(f"cannot read the training checkpoint in {folder}: {err}") from None


def _from_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return _safetensors(path)
    try:
        loaded = z2f.load_file(str(path))
    except ValueError as err:
        raise _user_error(str(err)) from None
    except Exception as err:  # not a torch file at all
        raise _user_error(f"{path} is not a PyTorch state-dict file ({type(err).__name__}: {err})") from None
    if isinstance(loaded, dict) and "module" in loaded and "buffer_names" in loaded:
        raise _user_error(f"{path} is one rank's model-states file",
                          f"pass its folder {path.parent} so every rank's partition is gathered")
    if not isinstance(loaded, dict) or not all(torch.is_tensor(v) for v in loaded.values()):
        raise _user_error(f"{path} does not hold a state dict (a dict of tensors)")
    return loaded


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors import safe_open
    except ImportError:
        raise _user_error(f"{path} needs the safetensors package", "pip install safetensors") from None
    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        aliases = json.loads((handle.metadata() or {}).get(z2f.SHARED_PARAMS_METADATA, "{}"))
    for alias, source in aliases.items():  # a tied weight is stored once; its other name is in the metadata
        if source in tensors:
            tensors[alias] = tensors[source]
    return tensors


def check_fits(model: nn.Module, state_dict: dict[str, torch.Tensor], where: str) -> None:
    """One line listing how ``state_dict`` and ``model`` disagree (missing, unexpected, mis-shaped keys)."""
    own = model.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    shapes = [f"{k}: checkpoint {list(state_dict[k].shape)}, model {list(own[k].shape)}"
              for k in own if k in state_dict and tuple(state_dict[k].shape) != tuple(own[k].shape)]
    if not (missing or unexpected or shapes):
        return
    parts = []
    for label, items in (("shape mismatches", shapes), ("missing keys", missing), ("unexpected keys", unexpected)):
        if items:
            parts.append(f"{len(items)} {label} ({'; '.join(items[:3])}{'; ...' if len(items) > 3 else ''})")
    raise _user_error(f"{where} does not fit {type(model).__name__}: " + ", ".join(parts),
                      "load the checkpoint into the model it was trained from")


def load_weights(model: nn.Module, source: str | dict[str, Any], base_dir: str = "",
                 transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> str:
    """Read ``source`` and copy it into ``model`` (built on the meta device: materialised first);
    ``transform`` rewrites the state dict first (an expert-parallel model keeps its own experts)."""
    state_dict, where = read_state_dict(source, base_dir)
    if transform is not None:
        state_dict = transform(state_dict)
    check_fits(model, state_dict, where)
    if any(p.is_meta for p in model.parameters()):
        unsaved = sorted(set(dict(model.named_buffers())) - set(state_dict))
        if unsaved:
            raise _user_error(f"{type(model).__name__} was built without values (meta device) and its buffers "
                              f"{unsaved[:3]} are not in the checkpoint", "build the model with real tensors")
        model.to_empty(device="cpu")
    model.load_state_dict(state_dict, strict=True)
    return where
