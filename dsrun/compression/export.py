"""A compressed model on disk: packed integer weights with their scales, and the loader that rebuilds it.

:func:`save_compressed` writes ``OUT/manifest.json`` (format, how to build the model, the attributes
redundancy_clean changed, each tensor's place in the blob) and ``OUT/weights.bin`` (every tensor once, tied
ones once): weights that :func:`dsrun.compression.redundancy_clean` quantized as their codes packed
1, 2, 4 or 8 bits each with one fp32 scale per group (and a one-byte zero point per group for the
asymmetric grid); everything else in its own dtype. Pruned rows, heads and channels are already gone from
the tensors. :func:`load_compressed` builds the model (from the recorded ``_target_`` or a model you pass),
applies the recorded shape changes, dequantizes, re-enables activation quantization and returns it in
eval mode: its outputs equal the cleaned model's.

:func:`post_training_quantize` is the zero-cost W8A8 path (ZeroQuant-style): group-wise 8-bit weights and
per-token dynamic 8-bit activations for a trained model, no training.
"""
from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dsrun.utils.errors import Problem, UserError

from . import layers
from .clean import RECORD_ATTR, CleanRecord
from .quantizers import Quantized, QuantSpec, dequantize, pack, quantize, signed_codes, unpack, unsigned_codes

FORMAT = "dsrun-compressed/1"
MANIFEST, BLOB = "manifest.json", "weights.bin"
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                       torch.int64, torch.int32, torch.uint8, torch.int8, torch.bool)}


class _Blob:
    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, tensor: torch.Tensor) -> list[int]:
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        place = [self.size, len(data)]
        self.parts.append(data)
        self.size += len(data)
        return place


def _quantized_entry(blob: _Blob, q: Quantized, dtype: torch.dtype) -> dict[str, Any]:
    return {"kind": "quantized", "shape": list(q.shape), "dtype": str(dtype).removeprefix("torch."),
            "bits": q.spec.bits, "scheme": q.spec.scheme, "groups": q.spec.groups,
            "codes": blob.add(pack(unsigned_codes(q), q.spec.bits)), "scale": blob.add(q.scale.float()),
            "zero_point": blob.add(q.zero_point.to(torch.uint8)) if q.zero_point is not None else None}


def _activation_settings(model: nn.Module) -> dict[str, dict[str, Any]]:
    out = {}
    for name, module in model.named_modules():
        if layers.is_compressed(module) and module.ds_compression.activation is not None:
            aq = module.ds_compression.activation
            out[name] = {"bits": aq.bits, "symmetric": aq.symmetric, "dynamic": aq.dynamic}
    return out


def save_compressed(model: nn.Module, out_dir: str | os.PathLike, builder: dict[str, Any] | None = None) -> Path:
    """Write ``model`` (cleaned by redundancy_clean, or any model) to ``out_dir``; ``builder`` is how to
    construct it again (``{"_target_": "pkg.Class", **kwargs}``), or None to require a model at load."""
    model = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    record: CleanRecord = model.__dict__.get(RECORD_ATTR) or CleanRecord()
    blob, tensors, aliases = _Blob(), {}, {}
    seen: dict[tuple, str] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if tensor.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        q = record.quantized.get(name)
        if q is not None and not torch.equal(dequantize(q, tensor.dtype), tensor):
            q = quantize(tensor, q.spec)  # changed since the clean: quantize it as it is now
        if q is not None:
            tensors[name] = _quantized_entry(blob, q, tensor.dtype)
        else:
            tensors[name] = {"kind": "tensor", "shape": list(tensor.shape),
                             "dtype": str(tensor.dtype).removeprefix("torch."), "data": blob.add(tensor)}
    manifest = {"format": FORMAT, "builder": builder, "structure": record.structure, "tensors": tensors,
                "aliases": aliases, "activation_quantization": _activation_settings(model), "blob_bytes": blob.size}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (BLOB + ".tmp")
    with open(tmp, "wb") as f:
        for part in blob.parts:
            f.write(part)
    os.replace(tmp, out / BLOB)
    (out / (MANIFEST + ".tmp")).write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(out / (MANIFEST + ".tmp"), out / MANIFEST)
    return out


def compressed_bytes(out_dir: str | os.PathLike) -> int:
    """Bytes of a saved compressed model on disk (manifest and blob)."""
    out = Path(out_dir)
    return (out / MANIFEST).stat().st_size + (out / BLOB).stat().st_size


def _build(builder: dict[str, Any]) -> nn.Module:
    kwargs = dict(builder)
    target = kwargs.pop("_target_", None)
    if not target:
        raise UserError(Problem(f"{MANIFEST}: builder", "has no _target_", "pass model= to load_compressed"))
    module_name, _, attr = target.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)(**kwargs)


def _view(data: torch.Tensor, place: list[int], dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    start, size = place
    return data[start:start + size].view(dtype).reshape(shape).clone()


def _decode(entry: dict[str, Any], data: torch.Tensor) -> torch.Tensor:
    dtype = _DTYPES[entry["dtype"]]
    if entry["kind"] == "tensor":
        return _view(data, entry["data"], dtype, entry["shape"])
    spec = QuantSpec(entry["bits"], entry["scheme"] == "symmetric", entry["groups"])
    numel = int(np.prod(entry["shape"])) if entry["shape"] else 1
    packed = _view(data, entry["codes"], torch.uint8, [entry["codes"][1]])
    codes = signed_codes(unpack(packed, spec.bits, numel), spec).reshape(spec.groups, -1)
    scale = _view(data, entry["scale"], torch.float32, [spec.groups, 1])
    zero_point = (_view(data, entry["zero_point"], torch.uint8, [spec.groups, 1]).to(torch.int32)
                  if entry["zero_point"] is not None else None)
    return dequantize(Quantized(codes, scale, zero_point, spec, torch.Size(entry["shape"])), dtype)


def _resize(model: nn.Module, name: str, shape: list[int], dtype: torch.dtype) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    live = getattr(owner, attr, None)
    if live is None or list(live.shape) == list(shape):
        return
    empty = torch.empty(shape, dtype=dtype, device=live.device)
    if isinstance(live, nn.Parameter):
        setattr(owner, attr, nn.Parameter(empty, requires_grad=live.requires_grad))
    else:
        owner.register_buffer(attr, empty)


def load_compressed(path: str | os.PathLike, model: nn.Module | None = None) -> nn.Module:
    """Rebuild the model :func:`save_compressed` wrote to ``path`` (into ``model`` if given: a model of the
    uncompressed architecture), in eval mode."""
    root = Path(path)
    manifest_file = root / MANIFEST
    if not manifest_file.is_file():
        raise UserError(Problem(str(root), f"has no {MANIFEST}", "pass the folder save_compressed or dsrun export wrote"))
    manifest = json.loads(manifest_file.read_text())
    if manifest.get("format") != FORMAT:
        raise UserError(Problem(str(manifest_file), f"format {manifest.get('format')!r} is not {FORMAT!r}"))
    if model is None:
        if not manifest.get("builder"):
            raise UserError(Problem(str(root), "does not record how to build the model", "pass model= to load_compressed"))
        model = _build(manifest["builder"])
    for module_name, attrs in manifest["structure"].items():
        module = model.get_submodule(module_name) if module_name else model
        for attr, value in attrs.items():
            setattr(module, attr, value)
    for module_name, settings in manifest["activation_quantization"].items():
        module = model.get_submodule(module_name)
        layers.make_compressed(module, module_name).activation = layers.ActivationQuantization(active=True, **settings)
        if not settings["dynamic"]:
            layers.register_activation_range(module)
    data = torch.from_numpy(np.fromfile(root / BLOB, dtype=np.uint8))
    state = {}
    for name, entry in manifest["tensors"].items():
        _resize(model, name, entry["shape"], _DTYPES[entry["dtype"]])
        state[name] = _decode(entry, data)
    for alias, name in manifest["aliases"].items():
        state[alias] = state[name]
    model.load_state_dict(state, strict=True)
    return model.eval()


def post_training_quantize(model: nn.Module, weight_bits: int = 8, activation_bits: int = 8, groups: int = 1,
                           modules: list[str] | None = None, symmetric: bool = True) -> nn.Module:
    """ZeroQuant-style zero-cost quantization of a trained model: ``weight_bits`` weights in ``groups``
    groups per matrix (per token for embeddings) and per-token dynamic ``activation_bits`` activations on
    ``modules`` (default every Linear/Conv2d/Embedding); the model is cleaned and ready for
    :func:`save_compressed`."""
    from .compress import init_compression, redundancy_clean
    from .scheduler import compression_scheduler

    kind = "symmetric" if symmetric else "asymmetric"
    config = {"compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "quantize_groups": groups,
                                  "quantization_type": kind, "schedule_offset": 0},
            "different_groups": {"wq": {"params": {"start_bits": weight_bits, "target_bits": weight_bits},
                                        "modules": modules or ["*"]}}},
        "activation_quantization": {
            "shared_parameters": {"enabled": True, "quantization_type": kind, "range_calibration": "dynamic",
                                  "schedule_offset": 0},
            "different_groups": {"aq": {"params": {"bits": activation_bits}, "modules": modules or ["*"]}}}}}
    init_compression(model, config)
    compression_scheduler(model).step(step_zero_check=True)
    return redundancy_clean(model, config)
