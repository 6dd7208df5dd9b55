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

from pathlib import Path
from typing import Any

import torch

from .reshard import FullOptimizerState
from .safe_load import load_file

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
