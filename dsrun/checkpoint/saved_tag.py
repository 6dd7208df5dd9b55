"""What a saved checkpoint tag holds, read from its files: the saved world size and ZeRO stage, each saved rank's
optimizer file and its optimizer state as dsrun's strategies read it (DeepSpeed's own files converted). Used by
the engine's load (:mod:`.engine_io`) and the universal conversion (:mod:`.ds_to_universal`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from . import deepspeed_format, layout
from .safe_load import load_file


def saved_world(model_states: dict[str, Any]) -> int:
    return int(model_states.get("dp_world_size", 1))


def saved_stage(model_states: dict[str, Any], tag_dir: Path) -> int:
    extras = model_states.get("dsrun") or {}
    if "zero_stage" in extras:
        return int(extras["zero_stage"])
    if any(tag_dir.glob("zero_pp_rank_*_model_states.pt")):
        return 3
    optim = sorted(tag_dir.glob("*zero_pp_rank_0_*optim_states.pt"))
    return int(load_file(optim[0])["optimizer_state_dict"]["zero_stage"]) if optim else 0


def optim_files(tag_dir: Path, world: int, bf16: bool, only: int | None = None, mp_rank: int = 0) -> list[Path]:
    """The saved ranks' optimizer files (``only``: that rank's alone) of tensor-parallel rank ``mp_rank``,
    preferring this run's precision prefix (as DeepSpeed does)."""
    for prefer in (bf16, not bf16):
        files = [tag_dir / layout.optim_states_name(r, prefer, mp_rank)
                 for r in (range(world) if only is None else [only])]
        if all(f.is_file() for f in files):
            return files
    raise FileNotFoundError(f"{tag_dir}: expected {world} '*_optim_states.pt' files (one per saved rank)")


def rank_optimizer_states(tag_dir: Path, model_states: dict[str, Any], stage: int, world: int,
                           bf16: bool, group_shapes: list[Any] | None = None, mp_rank: int = 0
                           ) -> list[dict[str, Any]]:
    """Every saved rank's optimizer state, as dsrun's strategies read it (DeepSpeed's own files converted;
    ``group_shapes``: the live strategy's, which a DeepSpeed stage-0 file needs)."""
    if stage == 0:
        return [stage0_state(model_states, group_shapes)]
    states = [deepspeed_format.load_zero_state(path) for path in optim_files(tag_dir, world, bf16, mp_rank=mp_rank)]
    refuse_mics(tag_dir, states[0])
    return states


def refuse_mics(tag_dir: Path, osd: dict[str, Any]) -> None:
    """A checkpoint saved under MiCS loads only into its own layout: a reshard of it is refused."""
    if int(osd.get("mics_shard_size", -1)) > 0:
        raise RuntimeError(f"{tag_dir}: saved under MiCS (mics_shard_size {osd['mics_shard_size']}), which "
                           "loads only into the same layout; rebuild the fp32 model with zero_to_fp32 instead")


def stage0_state(model_states: dict[str, Any], group_shapes: list[Any] | None) -> dict[str, Any]:
    sd = model_states["optimizer"]
    if deepspeed_format.is_deepspeed_stage0(sd):
        if group_shapes is None:
            raise RuntimeError("a DeepSpeed stage-0 checkpoint names no parameters: load it into an engine "
                               "with an optimizer")
        sd = deepspeed_format.stage0_to_dsrun(sd, group_shapes, model_states["module"])
    return sd
