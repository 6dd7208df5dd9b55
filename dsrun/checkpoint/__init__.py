"""Checkpoints in DeepSpeed's layout: atomic saves, exact resume, resharding, fp32 consolidation, 16-bit export.

The engine's ``save_checkpoint``/``load_checkpoint``/``save_16bit_model`` delegate here; ``dsrun.utils.zero_to_fp32``
(a standalone, torch-only file copied into every save dir) turns a checkpoint into one fp32 state dict.
"""
from __future__ import annotations

from .constants import *  # noqa: F403  (DeepSpeed's deepspeed.checkpoint exports its constants)
from .constants import UNIVERSAL_CHECKPOINT_INFO
from .deepspeed_checkpoint import DeepSpeedCheckpoint, ZeROCheckpoint
from .reshape_map import get_model_3d_descriptor, merge_state, model_3d_desc, reshape_meg_2d_parallel
from .engine_io import DS_KEYS, CheckpointTagError, load_checkpoint, save_checkpoint
from .export import save_16bit_model
from .layout import LATEST, list_tags, read_latest
from .safe_load import UnsafeCheckpointError, add_safe_globals, load_file
from .utils import clone_tensors_for_torch_save

__all__ = ["DS_KEYS", "LATEST", "UNIVERSAL_CHECKPOINT_INFO", "CheckpointTagError", "DeepSpeedCheckpoint",
           "ZeROCheckpoint", "get_model_3d_descriptor", "merge_state", "model_3d_desc", "reshape_meg_2d_parallel", "UnsafeCheckpointError", "add_safe_globals", "clone_tensors_for_torch_save",
           "list_tags",
           "load_checkpoint", "load_file", "read_latest", "save_16bit_model", "save_checkpoint"]
