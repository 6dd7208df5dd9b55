"""``dsrun convert to-hf``: a training checkpoint as a Hugging Face model folder.

The source is a run directory (its newest checkpoint, the model from its ``resolved.yaml``), a checkpoint
folder (the one holding ``latest``) or one tag's folder; the ZeRO partitions of every rank are consolidated into
the fp32 master weights (:func:`dsrun.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`: stages 0-3,
any number of ranks). Which model it is:

- the built-in GPT (``model._target_: dsrun.models.gpt.GPT`` in the run's ``resolved.yaml``, or ``--config`` a
  model name or YAML): written as a ``GPT2LMHeadModel``, with rotary positions a ``GPTNeoXForCausalLM``
  (:mod:`dsrun.models.hf`); options neither can express are refused, as is any other ``_target_``;
- a Hugging Face model trained through the ``deepspeed`` alias (its checkpoint keeps the model's own names): its
  ``config.json`` (beside ``latest`` or in the tag's folder, where the Trainer's ``checkpoint-N`` has it, or
  ``--config``) says which; the weights are written under their names with that config (``dtype`` float32:
  what the fp32 masters are), and a ``generation_config.json`` found beside it is copied.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsrun.checkpoint import layout
from dsrun.checkpoint.hf_folder import CONFIG_NAME, GENERATION_CONFIG_NAME, write_pretrained
from dsrun.checkpoint.training import CHECKPOINTS_DIR, latest_tag, no_checkpoint_reason
from dsrun.models.config import GPTConfig
from dsrun.models.hf import HFModel, gpt_state_shapes, gpt_to_hf, hf_layout, hf_refusal, key_differences
from dsrun.models.registry import GPT_TARGET, model_names, model_spec
from dsrun.rundir import RESOLVED_YAML
from dsrun.utils import zero_to_fp32 as z2f
from dsrun.utils.errors import ConfigError, Problem, UserError

SOURCE = "RUN_OR_CHECKPOINT"


@dataclass(frozen=True)
class Checkpoint:
    """Where the weights are: ``folder`` holds ``latest`` and the tags; ``run_dir`` the run's, if known."""

    folder: Path
    tag: str
    run_dir: Path | None

    @property
    def tag_dir(self) -> Path:
        return layout.resolve_tag_dir(self.folder, self.tag) or self.folder / self.tag


@dataclass(frozen=True)
class ModelSource:
    """The checkpoint's model: a Hugging Face ``config.json`` (``hf``, with the ``folder`` it was found in) or a
    dsrun model spec (``spec``, a ``_target_`` mapping); ``where`` names the file it came from."""

    where: str
    hf: dict[str, Any] | None = None
    folder: Path | None = None
    spec: dict[str, Any] | None = None


@dataclass(frozen=True)
class Exported:
    """What :func:`export` wrote."""

    layout: str  # "GPT-2", "GPT-NeoX" or the Hugging Face model_type
    files: list[str]
    tensors: int
    parameters: int
    seconds: float


def find_checkpoint(source: Path, tag: str | None) -> Checkpoint:
    """The checkpoint ``source`` names (see the module docstring), ``tag`` overriding ``latest``."""
    if not source.exists():
        raise UserError(Problem(SOURCE, f"no such file or folder: {source}",
                                "pass a run directory, a checkpoint folder or one tag's folder"))
    run_dir = None
    folder = source
    if (source / RESOLVED_YAML).is_file() and not (source / layout.LATEST).is_file():
        run_dir, folder = source, source / CHECKPOINTS_DIR
        if tag is None and layout.read_latest(folder) is None and not layout.list_tags(folder):
            raise UserError(Problem(SOURCE, *no_checkpoint_reason(source)))
    elif source.is_dir() and not (source / layout.LATEST).is_file() and any(source.glob(f"*{z2f.MODEL_SUFFIX}")):
        folder, tag = source.parent, tag or source.name  # one tag's folder
    if run_dir is None and folder.name == CHECKPOINTS_DIR and (folder.parent / RESOLVED_YAML).is_file():
        run_dir = folder.parent
    if tag is None:
        tag = latest_tag(folder, key=SOURCE)
        if tag is None:
            raise UserError(Problem(SOURCE, f"{source} holds no checkpoint (no '{layout.LATEST}', no tag folder with "
                                    f"'*{z2f.MODEL_SUFFIX}')", "pass a run directory, a checkpoint folder or one "
                                    "tag's folder"))
    elif layout.resolve_tag_dir(folder, tag) is None:
        raise UserError(Problem("--tag", f"no tag {tag!r} in {folder} (tags there: "
                                f"{', '.join(layout.list_tags(folder)) or 'none'})"))
    return Checkpoint(folder, tag, run_dir)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(Problem("--config", f"cannot read {path}: {err}")) from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise UserError(Problem("--config", f"{path} is not a Hugging Face config.json (no 'model_type')"))
    return data


def _model_from_yaml(path: Path, where: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    spec = loaded.get("model", loaded) if isinstance(loaded, dict) and path.name == RESOLVED_YAML else loaded
    if not isinstance(spec, dict):
        raise UserError(Problem(where, f"{path} holds no model section"))
    return spec


def _hf_source(path: Path) -> ModelSource:
    return ModelSource(str(path), hf=_read_json(path), folder=path.parent)


def model_source(checkpoint: Checkpoint, config: str | None) -> ModelSource:
    """The checkpoint's model: ``--config`` if given, else the run's ``resolved.yaml``, else a ``config.json`` in
    the tag's folder or beside ``latest``."""
    if config is not None:
        given = Path(config).expanduser()
        if given.is_dir() and (given / CONFIG_NAME).is_file():
            return _hf_source(given / CONFIG_NAME)
        if given.is_file() and given.suffix == ".json":
            return _hf_source(given)
        if given.is_file() and given.suffix in (".yaml", ".yml"):
            return ModelSource(str(given), spec=_model_from_yaml(given, "--config"))
        if config in model_names():
            return ModelSource(f"conf/model/{config}.yaml", spec=model_spec(config))
        raise UserError(Problem("--config", f"{config} is not a config.json, a folder holding one, a model YAML or "
                                f"a model name ({', '.join(model_names())})"))
    if checkpoint.run_dir is not None:
        resolved = checkpoint.run_dir / RESOLVED_YAML
        return ModelSource(str(resolved), spec=_model_from_yaml(resolved, RESOLVED_YAML))
    for folder in (checkpoint.tag_dir, checkpoint.folder):
        if (folder / CONFIG_NAME).is_file():
            return _hf_source(folder / CONFIG_NAME)
    raise UserError(Problem("--config", f"no model config for {checkpoint.folder}: no {RESOLVED_YAML} of a run above "
                            f"it, no {CONFIG_NAME} beside it", "pass --config (a Hugging Face config.json, a model "
                            "YAML or a model name such as gpt-small)"))


def gpt_config_of(spec: dict[str, Any], where: str) -> GPTConfig:
    """The built-in GPT's config from a model spec, refused (one line naming the option) when it is another
    model or a GPT that neither GPT-2 nor GPT-NeoX can express."""
    spec = dict(spec)
    target = spec.pop("_target_", GPT_TARGET)
    if target != GPT_TARGET:
        raise UserError(Problem("model._target_", f"{target!r} (in {where}) is not the built-in GPT ({GPT_TARGET}), "
                                "the one dsrun model with a Hugging Face layout (GPT-2 and GPT-NeoX have no "
                                "MoE experts)",
                                "a Hugging Face model trained through the alias exports with --config its config.json"))
    try:
        config = GPTConfig.from_kwargs(spec)
    except ConfigError as err:
        raise UserError([Problem(p.path, f"{p.message} (in {where})", p.hint) for p in err.problems]) from None
    refusal = hf_refusal(config)
    if refusal is not None:
        raise UserError(Problem(refusal.path, f"{refusal.message} (in {where})", refusal.hint))
    return config


def _hf_model(config: dict[str, Any], state: dict[str, torch.Tensor]) -> HFModel:
    """The checkpoint's tensors under their own names, a tied alias (the same tensor under a second name, as the
    consolidation returns it) left out, and the config with the masters' dtype."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensors[name] = tensor
    floating = {t.dtype for t in tensors.values() if t.is_floating_point()}
    written = {k: v for k, v in config.items() if k != "torch_dtype"}
    if floating == {torch.float32}:
        written["dtype"] = "float32"
    return HFModel(written, tensors)


def architecture_problem(model: HFModel) -> str | None:
    """How ``model``'s tensors differ from those of the model its config builds (built on the meta device:
    nothing allocated), or None; None too where transformers cannot build it here (then ``from_pretrained``,
    wherever it runs, is the check). A tied weight's second name may be absent, as ``save_pretrained`` leaves it."""
    try:
        import transformers

        built_config = transformers.AutoConfig.for_model(**model.config)
        with torch.device("meta"):
            built = transformers.AutoModelForCausalLM.from_config(built_config)
    except Exception:  # noqa: BLE001 - no transformers, a remote-code model, a config this version lacks
        return None
    expected: dict[str, tuple[int, ...]] = {}
    optional: set[str] = set()
    seen: set[int] = set()
    for name, tensor in built.state_dict(keep_vars=True).items():
        expected[name] = tuple(tensor.shape)
        if id(tensor) in seen:
            optional.add(name)  # a tied weight's second name
        seen.add(id(tensor))
    return key_differences(expected, model.tensors, optional)


def export(source: Path, out: Path, config: str | None = None, tag: str | None = None,
           max_shard_size: str = "5GB") -> Exported:
    """Write ``out`` from the checkpoint ``source`` names; see the module docstring."""
    started = time.perf_counter()
    try:
        z2f.parse_shard_size(max_shard_size)
    except ValueError as err:
        raise UserError(Problem("--max-shard-size", str(err))) from None
    if out.exists() and not out.is_dir():
        raise UserError(Problem("OUT", f"{out} is a file", "pass a folder to write the model's files into"))
    checkpoint = find_checkpoint(source, tag)
    model_of = model_source(checkpoint, config)
    gpt = gpt_config_of(model_of.spec or {}, model_of.where) if model_of.hf is None else None  # refused before reading
    try:
        state = dict(z2f.get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.folder), checkpoint.tag))
    except (ValueError, FileNotFoundError, KeyError) as err:
        raise UserError(Problem(SOURCE, f"cannot read the checkpoint {checkpoint.tag_dir}: {err}")) from None
    generation = None
    if gpt is not None:
        problem = key_differences(gpt_state_shapes(gpt), state)
        if problem is not None:
            raise UserError(Problem(SOURCE, f"{checkpoint.tag_dir} does not hold a GPT of the model in "
                                    f"{model_of.where}: {problem}"))
        model, kind = gpt_to_hf(gpt, state), hf_layout(gpt)
    else:
        assert model_of.hf is not None and model_of.folder is not None
        model, kind = _hf_model(model_of.hf, state), str(model_of.hf["model_type"])
        problem = architecture_problem(model)
        if problem is not None:
            raise UserError(Problem(SOURCE, f"the weights in {checkpoint.tag_dir} are not those of the model "
                                    f"{model_of.where} describes: {problem}", "pass --config the config.json of "
                                    "the model that was trained (a PEFT model: merge its adapters into the base "
                                    "and save that)"))
        path = model_of.folder / GENERATION_CONFIG_NAME
        generation = json.loads(path.read_text()) if path.is_file() else None
    files = write_pretrained(out, model.tensors, model.config, generation, max_shard_size)
    parameters = sum(t.numel() for t in model.tensors.values())
    return Exported(kind, files, len(model.tensors), parameters, time.perf_counter() - started)
