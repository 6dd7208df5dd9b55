"""Universal checkpoints (DeepSpeed's "Universal Checkpointing"): the training state kept per parameter, so it
loads at any world size and any ZeRO stage.

```
<checkpoint dir>/
├── latest_universal                  the universal folder's name (written by the conversion)
└── <tag>_universal/
    ├── mp_rank_00_model_states.pt    the model states: full module weights, scheduler, counters, client state
    └── zero/
        ├── optimizer_state.pt        param-group hyper-parameters and scalars (step), loss scaler, provenance
        └── <parameter name>/
            ├── fp32.pt               {"param": the full fp32 master value, "cat_dim": 0} (an AutoTP-split
            │                         parameter: its split dimension, and "param_n_sub_params" when fused)
            ├── exp_avg.pt, exp_avg_sq.pt ...   each optimizer state, in the same form
            └── step.pt               the optimizer step of the parameter's group
```

:mod:`dsrun.checkpoint.ds_to_universal` writes it from any dsrun ZeRO checkpoint; ``engine.load_checkpoint``
loads it (``checkpoint.load_universal: true`` makes a tag-less load read ``latest_universal``): this module
reads the per-parameter files back into the world-size-free state that :mod:`.reshard` cuts for the live
strategy's layout.
"""
from __future__ import annotations

import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch

from .autotp_meta import _get_param_uc_restore_meta, _narrow_sub_params, _resolve_autotp_partition
from .constants import EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, SUB_PARAM_SHAPE, VOCAB_TENSOR
from .reshard import FullOptimizerState
from .safe_load import add_safe_globals, load_file

__all__ = ["CAT_DIM", "FP32", "LATEST_UNIVERSAL", "OPTIMIZER_STATE", "PARAM", "PARAM_N_SUB_PARAMS", "STEP",
           "UNIVERSAL_DIR", "SubparamShape", "UniversalCheckpointGroups", "_get_param_uc_restore_meta", "_narrow_sub_params",
           "_resolve_autotp_partition", "enable_universal_checkpoint", "is_universal", "load_hp_checkpoint_state",
           "load_universal_state", "read_latest_universal"]

UNIVERSAL_DIR = "zero"
LATEST_UNIVERSAL = "latest_universal"
OPTIMIZER_STATE = "optimizer_state.pt"
PARAM = "param"
CAT_DIM = "cat_dim"  # a tensor-parallel split parameter's dimension (DeepSpeed's key; 0 for the others)
PARAM_N_SUB_PARAMS = "param_n_sub_params"  # its number of fused parts, when more than one (GPT-2's q|k|v: 3)
FP32 = "fp32"
STEP = "step"


def is_universal(tag_dir: Path) -> bool:
    """Whether ``tag_dir`` is a universal checkpoint folder."""
    return (Path(tag_dir) / UNIVERSAL_DIR / OPTIMIZER_STATE).is_file()


def read_latest_universal(save_dir: Path) -> str | None:
    path = Path(save_dir) / LATEST_UNIVERSAL
    return (path.read_text().strip() or None) if path.is_file() else None


def _value(entry: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
    return entry[PARAM] if isinstance(entry, dict) else entry


def load_universal_state(tag_dir: Path) -> FullOptimizerState:
    """The per-parameter state of the universal folder ``tag_dir``: fp32 masters, optimizer states, group
    scalars and hyper-parameters, the loss scaler."""
    root = Path(tag_dir) / UNIVERSAL_DIR
    meta = load_file(root / OPTIMIZER_STATE)
    full = FullOptimizerState(param_groups=list(meta.get("param_groups", [])),
                              precision=dict(meta.get("precision", {})),
                              group_scalars={int(k): dict(v) for k, v in (meta.get("group_scalars") or {}).items()})
    steps: dict[str, Any] = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        if not (folder / f"{FP32}.pt").is_file():
            continue
        name = folder.name
        full.fp32[name] = _value(load_file(folder / f"{FP32}.pt")).reshape(-1).float()
        for path in sorted(folder.glob("*.pt")):
            state = path.stem
            if state == FP32:
                continue
            if state == STEP:
                steps[name] = load_file(path)
                continue
            full.moments.setdefault(name, {})[state] = _value(load_file(path)).reshape(-1)
    if not full.fp32:
        raise FileNotFoundError(f"{root}: no '<parameter>/{FP32}.pt' files: not a universal checkpoint")
    groups_of = meta.get("param_group_of") or {}
    for name, step in steps.items():  # a folder written by DeepSpeed has no group scalars: take each group's step
        scalars = full.group_scalars.setdefault(int(groups_of.get(name, 0)), {})
        scalars.setdefault(STEP, step)
    return full


@dataclass
class SubparamShape:
    """A parameter made of sub-parameters (DeepSpeed's ``sub_param_shape`` entry of a merged ``fp32.pt``): the
    patterns naming it, its shape with a tuple of the sub-parameters' sizes at ``partition_dim``."""

    patterns: list[str]
    shape: tuple[Union[tuple[int, ...], int], ...]
    partition_dim: int


# a merged fused parameter's fp32.pt holds one: written here, or by DeepSpeed under its module's name
add_safe_globals(SubparamShape, (SubparamShape, "deepspeed.checkpoint.universal_checkpoint.SubparamShape"))


def _tp_slice_of(param: torch.Tensor, ckpt: dict[str, Any], full: torch.Tensor, tp_rank: int, tp_world_size: int,
                 path: str) -> torch.Tensor:
    """Rank ``tp_rank``'s flat slice of a whole universal value whose parameter carries no AutoTP metadata: cut
    back as it was merged (per sub-parameter, per fused part along ``cat_dim``, or evenly along ``cat_dim``)."""
    assert full.numel() == tp_world_size * param.numel(), (
        f"Loading {path} full param numel {full.numel()} != tensor slice numel {param.numel()} * tp_world_size "
        f"{tp_world_size}")
    sub_shape = ckpt.get(SUB_PARAM_SHAPE)
    cat_dim = ckpt.get("cat_dim", 0)
    if sub_shape:
        dim = sub_shape.partition_dim
        sizes = sub_shape.shape[dim] if isinstance(sub_shape.shape[dim], tuple) else (sub_shape.shape[dim],)
        view = full.view([sum(d) if isinstance(d, tuple) else d for d in sub_shape.shape])
        return _narrow_sub_params(view, dim, sizes, None, tp_rank, tp_world_size, 0.0)
    count = ckpt.get("param_n_sub_params", 1)
    if count > 1:
        return torch.cat([p.chunk(tp_world_size, dim=cat_dim)[tp_rank] for p in full.chunk(count, dim=cat_dim)],
                         dim=cat_dim).flatten()
    return full.chunk(tp_world_size, cat_dim)[tp_rank].flatten()


def load_hp_checkpoint_state(self: torch.Tensor, folder: str, tp_rank: int, tp_world_size: int, ep_rank: int = 0,
                             ep_size: int = 1) -> Any:
    """DeepSpeed's per-parameter universal load (bound to a parameter by :func:`enable_universal_checkpoint`):
    read each ``<state>.pt`` of ``folder``, cut this tensor-parallel rank's slice (by the parameter's AutoTP
    metadata when it carries it, else as the file says it was merged; an expert parameter first cut to its
    expert-parallel rank's experts; a vocabulary tensor padded to this degree), then this rank's fragment of it
    (``self._hp_mapping.lp_fragment_address``): the fp32 value into the master fragment, the others into
    ``optim_fragment``. Returns the saved step (None when there is none)."""
    mapping = self._hp_mapping
    mapping.optim_fragment = {}
    step = None
    for file in os.listdir(folder):
        if not file.endswith(".pt"):
            continue
        key, path = file[:-3], os.path.join(folder, file)
        ckpt = load_file(path)
        if key == "step":
            step = ckpt
            continue
        full = ckpt["param"]
        expert = ckpt.get(EP_IS_EXPERT_PARAM, False)
        if expert and ep_size > 1:
            experts = ckpt.get(EP_NUM_EXPERTS)
            assert experts is not None, f"Expert param in {path} missing '{EP_NUM_EXPERTS}' metadata"
            assert full.shape[0] == experts and experts % ep_size == 0, \
                f"{path}: {full.shape[0]} experts do not split over ep_size {ep_size}"
            local = experts // ep_size
            full = full[ep_rank * local:(ep_rank + 1) * local]
        has_meta = _get_param_uc_restore_meta(self) is not None
        rank, size = (0, 1) if full.shape == self.shape and not has_meta else (tp_rank, tp_world_size)
        if ckpt.get(VOCAB_TENSOR, False) and not expert and not has_meta:  # pad to this degree's vocabulary
            padded = self.shape[0] * size
            assert padded >= full.shape[0], f"Vocab tensor padded size {padded} < loaded universal size {full.shape[0]}"
            full = torch.nn.functional.pad(full, (0, 0, 0, padded - full.shape[0]))
        piece = _resolve_autotp_partition(self, ckpt, full, rank, size)
        if piece is None:
            piece = _tp_slice_of(self, ckpt, full, rank, size, path)
        address = mapping.lp_fragment_address
        fragment = piece.narrow(0, address.start, address.numel)
        if key == "fp32":
            target = mapping.get_hp_fragment()
            assert target.numel() == address.numel, \
                f"Load checkpoint {key} dst numel {target.numel()} != src numel {address.numel}"
            target.data.copy_(fragment.data)
        else:
            mapping.optim_fragment[key] = fragment.clone().detach()
    return step


def enable_universal_checkpoint(param_list: list[torch.Tensor]) -> None:
    """Give each parameter DeepSpeed's ``load_hp_checkpoint_state`` method."""
    for param in param_list:
        param.load_hp_checkpoint_state = types.MethodType(load_hp_checkpoint_state, param)


class UniversalCheckpointGroups:
    """DeepSpeed's optimizer-wrapper methods for universal checkpoints, over the 16-bit parameter groups the
    class names in ``lp_groups_attr``: :meth:`_enable_universal_checkpoint` gives every parameter
    ``load_hp_checkpoint_state`` and keeps the first model-level ``universal_checkpoint_info`` a parameter
    carries (the AutoTP info), which :meth:`_get_universal_checkpoint_info` returns afterwards."""

    lp_groups_attr = "bit16_groups"

    def _enable_universal_checkpoint(self) -> None:
        self._universal_checkpoint_info = None
        for group in getattr(self, self.lp_groups_attr):
            if self._universal_checkpoint_info is None:
                self._universal_checkpoint_info = next(
                    (info for p in group if (info := getattr(p, "universal_checkpoint_info", None)) is not None), None)
            enable_universal_checkpoint(group)

    def _get_universal_checkpoint_info(self) -> dict[str, Any] | None:
        return getattr(self, "_universal_checkpoint_info", None)
