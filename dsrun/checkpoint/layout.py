"""Names in a checkpoint folder (DeepSpeed's layout) and how a tag is chosen and checked.

```
save_dir/
├── latest                         the tag of the newest complete checkpoint, no newline
├── zero_to_fp32.py                standalone converter (torch only)
└── global_step<N>/
    ├── mp_rank_00_model_states.pt                     stages 0-2, data-parallel rank 0
    ├── zero_pp_rank_<r>_mp_rank_00_model_states.pt    stage 3, every rank
    ├── [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   stages 1-3, every rank
    ├── rng_states_rank_<r>.pt                         dsrun: each rank's RNG states (exact resume)
    └── optimizer_rank_states_<r>.pt                   dsrun: optimizer state that differs per data-parallel
                                                       rank (the 1-bit optimizers' error buffers)
```
A save is staged in ``save_dir/.<tag>.staging`` and renamed into place when every rank has written it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from dsrun.utils.errors import Problem, UserError

LATEST = "latest"
ZERO_TO_FP32 = "zero_to_fp32.py"
STAGING_SUFFIX = ".staging"
REPLACED_SUFFIX = ".replaced"
_TAG_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-+=]*$")


@dataclass(frozen=True)
class CheckpointLayout:
    """Which files a ZeRO strategy's state goes to (each strategy declares its own: ``strategy.checkpoint_layout``;
    the save and load code reads it instead of branching on the stage)."""

    stage: int
    model_states_every_rank: bool  # zero_pp_rank_<r>_mp_rank_00_model_states.pt on every rank (partitioned weights)
    optimizer_in_model_states: bool  # the whole optimizer state inside mp_rank_00_model_states.pt (stage 0)
    optimizer_file_per_rank: bool  # [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt
    module_holds_placeholders: bool  # the module's parameters are shards: they load through the masters
    # why the state loads only into this very layout (MiCS: masters cut over shard groups resharding does not
    # know), or None when a load may reshard it to any world size or stage
    reshard_refusal: str | None = None

    def model_states_name(self, dp_rank: int, mp_rank: int = 0) -> str:
        return model_states_name(3 if self.model_states_every_rank else 0, dp_rank, mp_rank)

    def writes_model_states(self, dp_rank: int) -> bool:
        return self.model_states_every_rank or dp_rank == 0


def layout_for_stage(stage: int) -> CheckpointLayout:
    """DeepSpeed's layout of ZeRO stage ``stage`` (also for an engine without an optimizer)."""
    return CheckpointLayout(stage=stage, model_states_every_rank=stage == 3, optimizer_in_model_states=stage == 0,
                            optimizer_file_per_rank=stage >= 1, module_holds_placeholders=stage == 3)


def model_states_name(stage: int, dp_rank: int, mp_rank: int = 0) -> str:
    if stage == 3:
        return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def rank_model_states(tag_dir: Path, mp_rank: int) -> Path:
    """Tensor-parallel rank ``mp_rank``'s model states file in ``tag_dir``: ``mp_rank_XX`` (stages 0-2), else the
    stage-3 file of its data rank 0 (every data rank's holds the same module entries and shapes)."""
    plain = Path(tag_dir) / model_states_name(0, 0, mp_rank)
    return plain if plain.is_file() else Path(tag_dir) / model_states_name(3, 0, mp_rank)


def optim_states_name(dp_rank: int, bf16: bool, mp_rank: int = 0) -> str:
    prefix = "bf16_" if bf16 else ""
    return f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def rng_states_name(rank: int) -> str:
    return f"rng_states_rank_{rank}.pt"


def rank_states_name(dp_rank: int) -> str:
    return f"optimizer_rank_states_{dp_rank}.pt"


def default_tag(global_steps: int) -> str:
    return f"global_step{global_steps}"


def check_tag(tag: str) -> str:
    """A tag names one folder: letters, digits, ``_ . - + =``, not starting with a dot."""
    if not _TAG_PATTERN.match(tag):
        raise UserError(Problem("save_checkpoint(tag=...)", f"got {tag!r}; a tag is one folder name of letters, "
                                "digits and _ . - + =, not starting with a dot", "e.g. tag='global_step100'"))
    return tag


def staging_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f".{tag}{STAGING_SUFFIX}"


def replaced_dir(save_dir: Path, tag: str) -> Path:
    """Where the previous copy of a re-saved tag waits while the new one is renamed in."""
    return save_dir / f".{tag}{REPLACED_SUFFIX}"


def repair(save_dir: Path) -> list[Path]:
    """Tidy up after interrupted saves: a set-aside copy whose tag folder is missing (the crash fell between
    the two renames of a re-save) is renamed back, as it is the only copy of that tag. Returns the leftovers
    to delete: staging folders, temporary files, and set-aside copies of tags that exist again."""
    stale = []
    for entry in sorted(save_dir.iterdir()) if save_dir.is_dir() else []:
        name = entry.name
        if not name.startswith("."):
            continue
        if name.endswith(STAGING_SUFFIX) or ".tmp" in name:
            stale.append(entry)
        elif name.endswith(REPLACED_SUFFIX):
            original = save_dir / name[1:-len(REPLACED_SUFFIX)]
            if original.is_dir():
                stale.append(entry)
            else:
                entry.rename(original)
    return stale


def read_latest(save_dir: str | os.PathLike) -> str | None:
    path = Path(save_dir) / LATEST
    if not path.is_file():
        return None
    return path.read_text(errors="replace").strip() or None  # damaged bytes read as a tag that does not exist


def resolve_tag_dir(save_dir: str | os.PathLike, tag: str) -> Path | None:
    """The folder holding tag ``tag``; a tag whose re-save was interrupted mid-swap is found in its
    ``.replaced`` copy. None when neither exists."""
    save_dir = Path(save_dir)
    for candidate in (save_dir / tag, replaced_dir(save_dir, tag)):
        if candidate.is_dir():
            return candidate
    return None


def list_tags(save_dir: str | os.PathLike) -> list[str]:
    """Complete checkpoint tags under ``save_dir`` (folders with a model states file), oldest first by the
    step number in the name (then by name)."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    tags = [p.name for p in save_dir.iterdir()
            if p.is_dir() and not p.name.startswith(".") and any(p.glob("*model_states.pt"))]

    def key(tag: str) -> tuple[int, str]:
        match = re.search(r"(\d+)$", tag)
        return (int(match.group(1)) if match else -1, tag)

    return sorted(tags, key=key)
