"""Layer reduction: a shallower student initialised from chosen layers of its teacher, and distillation.

``layer_reduction`` names the student's layer list (``module_name_prefix``, e.g. ``transformer.h`` for
dsrun's GPT or ``bert.encoder.layer`` for BERT) and, per kept layer, the teacher layer it starts from
(``teacher_layer``); ``other_module_name`` lists further modules copied from the teacher under the same
name (embeddings, final norm, head).

With a teacher, the student must already have ``keep_number_layer`` layers (DeepSpeed's tutorial builds
it with ``num_hidden_layers = keep_number_layer``). Without one, the model passed in is the teacher and
keeps only its layers ``teacher_layer``, in that order; a ``config`` attribute counting its layers
(``n_layer``, ``num_hidden_layers``, ``num_layers``) follows.

:func:`distillation_loss` is the knowledge-distillation term a layer-reduced student usually trains with.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dsrun.utils.errors import Problem, UserError

if TYPE_CHECKING:
    from dsrun.config.compression import LayerReductionConfig

WHERE = "compression_training.layer_reduction"
LAYER_COUNT_ATTRS = ("n_layer", "num_hidden_layers", "num_layers")


def _submodule(model: nn.Module, name: str, where: str, whose: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise UserError(Problem(where, f"{name!r} is not a module of the {whose}",
                                "name it by its dotted path in model.named_modules()")) from None


def _copy_module(student: nn.Module, teacher: nn.Module, name_s: str, name_t: str) -> None:
    source = teacher.state_dict()
    target = student.state_dict()
    if set(source) != set(target) or any(source[k].shape != target[k].shape for k in source):
        raise UserError(Problem(WHERE, f"student module {name_s!r} and teacher module {name_t!r} differ in shape",
                                "the student keeps the teacher's width; only the number of layers changes"))
    with torch.no_grad():
        for key, value in target.items():
            value.copy_(source[key])


def _set_layer_count(model: nn.Module, old: int, new: int) -> None:
    config = getattr(model, "config", None)
    for attr in LAYER_COUNT_ATTRS:
        if config is not None and getattr(config, attr, None) == old:
            try:
                setattr(config, attr, new)
            except (AttributeError, TypeError):  # a frozen config: rebuild it with the new count
                import dataclasses

                if dataclasses.is_dataclass(config):
                    model.config = dataclasses.replace(config, **{attr: new})


def student_initialization(student_model: nn.Module, teacher_model: nn.Module | None,
                           config: LayerReductionConfig) -> None:
    """Initialise ``student_model`` from ``teacher_model`` as ``config`` (the ``layer_reduction`` section)
    says; without a teacher, reduce ``student_model``'s own layers."""
    prefix = config.module_name_prefix
    chosen = list(config.teacher_layer or [])
    if teacher_model is None:
        if prefix is None:
            raise UserError(Problem(WHERE, "without a teacher model, module_name_prefix and teacher_layer choose "
                                    "the layers to keep", "pass teacher_model= or set both keys"))
        layers = _submodule(student_model, prefix, f"{WHERE}.module_name_prefix", "model")
        if not isinstance(layers, (nn.ModuleList, nn.Sequential)):
            raise UserError(Problem(f"{WHERE}.module_name_prefix", f"{prefix!r} is a {type(layers).__name__}, "
                                    "not a ModuleList of layers"))
        if any(i >= len(layers) for i in chosen):
            raise UserError(Problem(f"{WHERE}.teacher_layer", f"got {chosen}; the model has {len(layers)} layers "
                                    f"under {prefix!r}"))
        parent_name, _, attr = prefix.rpartition(".")
        parent = student_model.get_submodule(parent_name) if parent_name else student_model
        setattr(parent, attr, type(layers)(*[layers[i] for i in chosen]) if isinstance(layers, nn.Sequential)
                else nn.ModuleList(layers[i] for i in chosen))
        _set_layer_count(student_model, len(layers), len(chosen))
        return
    if prefix is not None and chosen:
        student_layers = _submodule(student_model, prefix, f"{WHERE}.module_name_prefix", "student")
        teacher_layers = _submodule(teacher_model, prefix, f"{WHERE}.module_name_prefix", "teacher")
        if len(student_layers) != config.keep_number_layer:
            raise UserError(Problem(f"{WHERE}.keep_number_layer", f"is {config.keep_number_layer} but the student has "
                                    f"{len(student_layers)} layers under {prefix!r}",
                                    "build the student with keep_number_layer layers"))
        for i, t in enumerate(chosen):
            if t >= len(teacher_layers):
                raise UserError(Problem(f"{WHERE}.teacher_layer", f"index {t} is past the teacher's "
                                        f"{len(teacher_layers)} layers"))
            _copy_module(student_layers[i], teacher_layers[t], f"{prefix}.{i}", f"{prefix}.{t}")
    for name in config.other_module_name or []:
        where = f"{WHERE}.other_module_name"
        _copy_module(_submodule(student_model, name, where, "student"), _submodule(teacher_model, name, where, "teacher"),
                     name, name)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
                      ignore: torch.Tensor | None = None) -> torch.Tensor:
    """``T² · KL(softmax(teacher/T) ‖ softmax(student/T))`` averaged over positions (rows of the last
    dimension); positions where ``ignore`` is True do not count."""
    s = F.log_softmax(student_logits.float().reshape(-1, student_logits.shape[-1]) / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float().reshape(-1, teacher_logits.shape[-1]) / temperature, dim=-1)
    per_position = (t.exp() * (t - s)).sum(dim=-1)
    if ignore is not None:
        keep = ~ignore.reshape(-1)
        per_position = per_position[keep]
    return per_position.mean() * temperature ** 2


class Distiller:
    """The training loss of a student taught by ``teacher``: its own loss plus ``weight`` times the
    distillation term at ``temperature``. For models called ``model(inputs, targets, return_logits=True)``
    that return ``(loss, logits)`` (dsrun's GPT)."""

    def __init__(self, teacher: nn.Module, weight: float = 1.0, temperature: float = 1.0):
        self.teacher = teacher.eval()
        self.weight = float(weight)
        self.temperature = float(temperature)
        for p in self.teacher.parameters():
            p.requires_grad_(False)

    def loss(self, student: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss, logits = student(inputs, targets, return_logits=True)
        if self.weight == 0:
            return loss
        with torch.no_grad():
            if next(self.teacher.parameters()).device != inputs.device:
                self.teacher.to(inputs.device)
            teacher_logits = self.teacher(inputs)
        kd = distillation_loss(logits, teacher_logits.to(logits.device), self.temperature, targets.eq(-100))
        return loss + self.weight * kd


def load_teacher(run_dir: str) -> nn.Module:
    """The trained model of a finished dsrun run directory (its ``resolved.yaml`` model, the fp32 weights of
    its latest checkpoint), in eval mode."""
    from pathlib import Path

    import hydra.utils
    from omegaconf import OmegaConf

    from dsrun.checkpoint.training import CHECKPOINTS_DIR, no_checkpoint_reason
    from dsrun.rundir import RESOLVED_YAML
    from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root = Path(run_dir)
    spec_file = root / RESOLVED_YAML
    checkpoints = root / CHECKPOINTS_DIR
    if not spec_file.is_file():
        raise UserError(Problem("train.teacher", f"{root} is not a dsrun run directory (no {RESOLVED_YAML})",
                                "pass the teacher's run directory"))
    if not (checkpoints / "latest").is_file():
        raise UserError(Problem("train.teacher", *no_checkpoint_reason(root)))
    spec = OmegaConf.load(spec_file)
    teacher = hydra.utils.instantiate(spec.model, _convert_="all")
    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoints))
    teacher.load_state_dict(state, strict=False)
    return teacher.eval()
