"""``dsrun export``: a run directory's trained model, compressed for real.

The model is rebuilt from the run's ``resolved.yaml``, its weights (with the masks and learned scores,
which are module state) come from the consolidated checkpoint, the compression schedule's position from
the checkpoint's ``compression`` entry; then :func:`~dsrun.compression.redundancy_clean` (or MoQ's last bit
widths, or :func:`~dsrun.compression.export.post_training_quantize`) and
:func:`~dsrun.compression.export.save_compressed`.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dsrun.utils.errors import Problem, UserError

from .clean import record_of
from .export import compressed_bytes, post_training_quantize, save_compressed
from .quantizers import QuantSpec, dequantize, quantize

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from dsrun.config.misc import QuantizeTrainingConfig


def _run_files(run_dir: Path, tag: str | None) -> tuple[DictConfig, dict[str, torch.Tensor], dict[str, Any]]:
    from omegaconf import OmegaConf

    from dsrun.checkpoint.layout import read_latest
    from dsrun.checkpoint.training import CHECKPOINTS_DIR, no_checkpoint_reason
    from dsrun.rundir import RESOLVED_YAML
    from dsrun.utils import zero_to_fp32 as z2f

    spec_file, checkpoints = run_dir / RESOLVED_YAML, run_dir / CHECKPOINTS_DIR
    if not spec_file.is_file():
        raise UserError(Problem("RUN_DIR", f"{run_dir} has no {RESOLVED_YAML}", "pass a dsrun run directory"))
    if tag is None and read_latest(checkpoints) is None:
        raise UserError(Problem("RUN_DIR", *no_checkpoint_reason(run_dir)))
    try:
        tag_dir = Path(z2f.resolve_tag_dir(str(checkpoints), tag))
        state = z2f.get_fp32_state_dict_from_zero_checkpoint(str(checkpoints), tag)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(Problem("RUN_DIR", f"no usable checkpoint in {checkpoints}: {exc}",
                                "pass --tag with one of the tag folders there")) from None
    model_states = z2f.load_file(str(sorted(tag_dir.glob("*model_states.pt"))[0]))
    return OmegaConf.load(spec_file), state, model_states.get("compression") or {}


def _builder(spec: DictConfig, model: nn.Module) -> dict[str, Any]:
    from omegaconf import OmegaConf

    builder = OmegaConf.to_container(spec.model, resolve=True)
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict"):  # e.g. a layer-reduced GPT: its n_layer as built
        builder.update(config.to_dict())
    return builder


def record_moq_weights(model: nn.Module, quantize_training: QuantizeTrainingConfig,
                       moq_state: dict[str, Any]) -> None:
    """Quantize each MoQ weight to the bit width its schedule had reached, recording codes for export."""
    algo = quantize_training.quantize_algo
    record = record_of(model)
    params = dict(model.named_parameters())
    for name, (bits, *_rest) in moq_state.get("weights", {}).items():
        param = params[name]
        q = quantize(param.detach(), QuantSpec(bits, algo.q_type == "symmetric", quantize_training.quantize_groups))
        with torch.no_grad():
            param.copy_(dequantize(q, param.dtype))
        record.quantized[name] = q


def export_run(run_dir: Path, out: Path, tag: str | None = None, w8a8: bool = False, groups: int = 1) -> dict[str, Any]:
    import hydra.utils

    from dsrun.config import load_ds_config

    from .compress import init_compression, redundancy_clean
    from .scheduler import compression_scheduler

    from omegaconf import OmegaConf

    spec, state, compression_state = _run_files(Path(run_dir), tag)
    raw_ds = OmegaConf.to_container(spec.ds, resolve=True)
    # the run's batch size was resolved for its world size; here only the compression sections matter
    ds = load_ds_config({k: v for k, v in raw_ds.items() if k != "train_batch_size"}, world_size=1)
    model = hydra.utils.instantiate(spec.model, _convert_="all")
    before = sum(p.numel() for p in model.parameters())
    if w8a8:
        model.load_state_dict(state, strict=False)
        post_training_quantize(model, groups=groups)
    elif ds.compression_training.layer_reduction.enabled or any(
            getattr(ds.compression_training, t).shared_parameters.enabled for t in
            ("weight_quantization", "activation_quantization", "sparse_pruning", "row_pruning", "head_pruning",
             "channel_pruning")):
        reduction = type(ds.compression_training.layer_reduction)()  # off: the student was built at its reduced
        section = ds.compression_training.model_copy(update={"layer_reduction": reduction})  # depth; weights below
        init_compression(model, section)
        model.load_state_dict(state, strict=True)
        scheduler = compression_scheduler(model)
        if compression_state.get("scheduler"):
            scheduler.load_state_dict(compression_state["scheduler"])
        else:
            scheduler.step(step_zero_check=True)
        redundancy_clean(model, section)
    elif ds.quantize_training.enabled and compression_state.get("moq"):
        model.load_state_dict(state, strict=False)
        record_moq_weights(model, ds.quantize_training, compression_state["moq"])
    else:
        raise UserError(Problem("RUN_DIR", "the run used no compression_training or quantize_training",
                                "use --w8a8 for a post-training 8-bit export"))
    model.eval()
    save_compressed(model, out, builder=_builder(spec, model))
    size, after = compressed_bytes(out), sum(p.numel() for p in model.parameters())
    return {"parameters_before": before, "parameters_after": after, "bytes": size, "fp32_bytes": 4 * before,
            "ratio": size / (4 * before)}
