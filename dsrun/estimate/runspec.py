"""From a composed RunSpec (model/data/train/launcher/ds) to :class:`EstimateInputs`, with provenance.

The model is instantiated from ``cfg.model`` on the meta device, so its parameters are counted without
allocating them. Every other number is looked up in the RunSpec; :func:`inputs_from_runspec` returns, next
to the inputs, where each one came from (a key path, or "default"), so the report can say so. Keys read:

* ``ds``: ``zero_optimization`` (stage, offload, buckets), ``bf16.enabled`` / ``fp16.enabled``,
  ``optimizer.type`` and ``optimizer.params``, ``train_micro_batch_size_per_gpu`` (or
  ``train_batch_size / gradient_accumulation_steps / world size``);
* ``launcher``: nodes from ``num_nodes`` / ``nnodes`` / ``nodes``; ranks per node from ``num_procs`` /
  ``num_gpus`` / ``nproc_per_node`` / ``gpus_per_node`` (the CLI prefers the launch plan when it can make
  one, which also covers hostfiles);
* sequence length: ``data.seq_len`` / ``data.block_size`` / ``data.sequence_length``, else the model's
  ``block_size``;
* activation checkpointing: ``train.activation_checkpointing`` / ``model.activation_checkpointing`` /
  ``model.gradient_checkpointing``;
* tensor parallelism: ``ds.tensor_parallel.autotp_size`` (the model is then counted as one rank's share, split
  on the meta device by the ``split`` the caller hands :func:`build_recipe_model`);
* data: the token array's bytes (``data_pipeline_bytes``), which a rank maps from disk;
* the GPT shape from the built model's ``config`` (``n_layer``, ``n_embd``, ``n_head``, ``vocab_size``,
  optional ``ffn_hidden``, ``dropout``, ``flash`` and ``positions``), else from the same keys under
  ``cfg.model``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch

from dsrun.estimate.counting import ParameterCounts, count_parameters, instantiate_on_meta
from dsrun.estimate.inputs import BufferSettings, EstimateInputs, GPTShape
from dsrun.activation_checkpointing.modes import CheckpointMode
from dsrun.utils.errors import ConfigError, Problem

if TYPE_CHECKING:
    from dsrun.config import DSConfig

_MISSING = object()


def plain_config(value: object) -> Any:
    """A DictConfig/ListConfig as plain containers (resolving interpolations); any other value unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _get(tree: object, path: str) -> Any:
    """The value at the dotted ``path`` of nested mappings, or _MISSING (``tree``: any value; only mappings
    are entered)."""
    node = tree
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node or node[part] is None:
            return _MISSING
        node = node[part]
    return node


def _first(tree: Mapping[str, Any], paths: Iterable[str], default: object) -> tuple[Any, str]:
    for path in paths:
        value = _get(tree, path)
        if value is not _MISSING:
            return value, path
    return default, "default"


def small_parameter_count(model: torch.nn.Module, threshold: int) -> int:
    """Parameters (each counted once) with fewer than ``threshold`` elements: ZeRO-3 keeps these whole."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if p.numel() < threshold)


def kept_fp32_parameter_counts(model: torch.nn.Module, setting: str | list[str], precision: str) -> tuple[int, int]:
    """(all, trainable) elements of the parameters ``data_types.keep_in_fp32_modules`` (``setting``) keeps fp32 in
    ``model`` under ``precision`` (each counted once; none in fp32), by the rule the engine's cast applies."""
    from dsrun.precision.keep_fp32 import kept_names

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)
    names = kept_names(model, setting, dtype)
    kept = {id(p): p for n, p in model.named_parameters(remove_duplicate=False) if n in names}.values()
    return sum(p.numel() for p in kept), sum(p.numel() for p in kept if p.requires_grad)


def gpt_shape_of(model: torch.nn.Module | None, model_cfg: Mapping[str, Any]) -> GPTShape | None:
    """The GPT shape of ``model`` (its ``config`` attribute) or of its config keys; None if not a GPT."""
    sources: list[Any] = []
    if model is not None and getattr(model, "config", None) is not None:
        sources.append(model.config)
    sources.append(model_cfg)
    for src in sources:
        get = (lambda k, s=src: s.get(k)) if isinstance(src, Mapping) else (lambda k, s=src: getattr(s, k, None))
        fields = {k: get(k) for k in ("n_layer", "n_embd", "n_head", "vocab_size")}
        if all(isinstance(v, int) for v in fields.values()):
            flash = get("flash")
            return GPTShape(**fields, ffn_hidden=get("ffn_hidden") if isinstance(get("ffn_hidden"), int) else None,
                            flash_attention=True if flash is None else bool(flash),
                            dropout=bool(get("dropout") or 0), rotary=get("positions") == "rotary",
                            tied_embeddings=bool(get("tie_embeddings")))
    return None


@dataclass(frozen=True)
class RecipeModel:
    """A recipe's model, as the estimator sees it: the meta-device module, its counts and its shape.

    With AutoTP (``tp_size`` > 1) ``module`` and ``counts`` are one rank's split model and ``unsplit_params``
    the whole model's count; ``tp_size`` 1 is the whole model."""

    module: torch.nn.Module | None
    counts: ParameterCounts
    shape: GPTShape | None
    block_size: int | None
    tp_size: int = 1
    unsplit_params: int | None = None


# splits a meta-device model in place for one rank of a tensor-parallel group of the given size
# (dsrun.tensor_parallel.spec_split.meta_split_for: the training split, in a room above the estimator)
TPSplit = Callable[[torch.nn.Module, int], None]


def autotp_size_of(cfg: Mapping[str, Any]) -> int:
    """The run's ``tensor_parallel.autotp_size`` (1 without AutoTP)."""
    from dsrun.config import ds_section

    ds = plain_config(cfg).get("ds") or {}
    return max(1, int(ds_section(ds, "tensor_parallel").autotp_size or 1))


def build_recipe_model(cfg: Mapping[str, Any], split: TPSplit | None = None) -> RecipeModel:
    """Instantiate ``cfg.model`` on the meta device and count it (no weights are allocated). With
    ``tensor_parallel.autotp_size`` T > 1 and a ``split``, the model is split as rank 0 of a group of T splits it
    (every rank's share is the same, or rank 0's the largest where a rule cuts unevenly) and counted as that share; without ``split`` it is
    counted whole (an over-estimate of the model states)."""
    model_cfg = cfg.get("model")
    if not model_cfg or "_target_" not in model_cfg:
        raise ConfigError(Problem("model._target_", "the recipe has no model to build",
                                  "pick a model (model=...) or pass --total-params"))
    module = instantiate_on_meta(model_cfg)
    plain_cfg = plain_config(model_cfg)
    block = getattr(getattr(module, "config", None), "block_size", None) or plain_cfg.get("block_size")
    shape = gpt_shape_of(module, plain_cfg)  # the unsplit shape: activations divide it by the degree themselves
    tp = autotp_size_of(cfg)
    if tp > 1 and split is not None:
        unsplit = count_parameters(module).total
        split(module, tp)
        return RecipeModel(module=module, counts=count_parameters(module), shape=shape,
                           block_size=int(block) if block else None, tp_size=tp, unsplit_params=unsplit)
    return RecipeModel(module=module, counts=count_parameters(module), shape=shape,
                       block_size=int(block) if block else None)


def _precision(ds: DSConfig | Mapping[str, Any] | None) -> tuple[str, str]:
    from dsrun.config import ds_section

    if ds_section(ds, "bf16").enabled:
        return "bf16", "ds.bf16.enabled"
    if ds_section(ds, "fp16").enabled:
        return "fp16", "ds.fp16.enabled"
    return "fp32", "default"


def data_pipeline_bytes(data_cfg: Mapping[str, Any]) -> tuple[int, str]:
    """Resident bytes of a recipe's data pipeline and where the figure came from.

    dsrun's corpora memory-map one token array and read windows from it, so a rank's resident share is at
    most the array: ``data.max_bytes`` tokens stored as uint16 (2 bytes each) for the byte-level
    standard-library corpus (``data=pystdlib``), the files' sizes for ``data=tokens``. The batches themselves (two int64 tensors of micro batch x sequence) are negligible
    next to it and counted too by the caller's activations. 0 when the size cannot be known in advance.
    """
    import os

    target = str(data_cfg.get("_target_", ""))
    if target.endswith("pystdlib_corpus"):
        max_bytes = data_cfg.get("max_bytes", 4_000_000)
        tokenizer = str(data_cfg.get("tokenizer", "bytes"))
        if max_bytes is not None and tokenizer == "bytes":
            return 2 * int(max_bytes), "2 x data.max_bytes (uint16 byte tokens, memory-mapped)"
        return 0, "unknown (not byte tokens)"
    total, found = 0, False
    for key in ("path", "eval_path"):
        path = data_cfg.get(key)
        if isinstance(path, str) and os.path.isfile(path):
            total += os.path.getsize(path)
            found = True
    return (total, "data.path file size (memory-mapped)") if found else (0, "unknown")


def inputs_from_runspec(cfg: Mapping[str, Any], model: RecipeModel) -> tuple[EstimateInputs, dict[str, str]]:
    """:class:`EstimateInputs` for a composed RunSpec and its counted model, and each input's source."""
    from dsrun.config import ds_section  # the schema's typed sections: the one source of every default

    tree = plain_config(cfg)
    ds = tree.get("ds") or {}
    zero = ds_section(ds, "zero_optimization")  # the legacy boolean form is stage 1, as in a run
    sources: dict[str, str] = {}

    nodes, sources["nodes"] = _first(tree, ["launcher.num_nodes", "launcher.nnodes", "launcher.nodes"], 1)
    rpn, sources["ranks_per_node"] = _first(
        tree, ["launcher.num_procs", "launcher.num_gpus", "launcher.nproc_per_node", "launcher.gpus_per_node"], 1)
    nodes, rpn = int(nodes), int(rpn)
    stage = int(zero.stage)
    sources["zero_stage"] = "ds.zero_optimization.stage" if "stage" in zero.model_fields_set else "default"
    precision, sources["precision"] = _precision(ds)
    optimizer = ds_section(ds, "optimizer")
    # no optimizer.type is the client's optimizer in a run (the schema's None); the estimate assumes Adam
    opt_type = str(optimizer.type if optimizer.type is not None else "adam")
    sources["optimizer"] = "ds.optimizer.type" if optimizer.type is not None else "default"

    sp = int(ds_section(ds, "sequence_parallel_size"))
    sources["sequence_parallel_size"] = "ds.sequence_parallel_size" if sp > 1 else "default"
    tp = autotp_size_of(tree)
    if tp > 1:  # the counts are one rank's when the model was split for the degree, else the whole model's
        sources["tensor_parallel_size"] = "ds.tensor_parallel.autotp_size" + (
            " (counts: one rank's split model)" if model.tp_size == tp else " (counts: the whole model)")
    mbs = ds_section(ds, "train_micro_batch_size_per_gpu")  # as given ("auto": None), not resolved
    gas = ds_section(ds, "gradient_accumulation_steps")
    sources["micro_batch_size"] = "ds.train_micro_batch_size_per_gpu"
    if mbs is None and ds_section(ds, "train_batch_size") is not None:
        mbs = max(1, ds_section(ds, "train_batch_size") // (gas or 1) // max(1, nodes * rpn // sp // tp))
        sources["micro_batch_size"] = ("ds.train_batch_size / gradient_accumulation_steps / (world size / "
                                       "sequence_parallel_size / autotp_size)")
    if mbs is None:
        mbs, sources["micro_batch_size"] = 1, "default"
    seq, sources["seq_len"] = _first(tree, ["data.seq_len", "data.block_size", "data.sequence_length"], None)
    if seq is None:
        seq, sources["seq_len"] = (model.block_size, "model.block_size") if model.block_size else (1024, "default")
    ckpt, sources["activation_checkpointing"] = _first(
        tree, ["train.activation_checkpointing", "model.activation_checkpointing",
               "model.gradient_checkpointing"], False)
    if isinstance(ckpt, Mapping):  # e.g. {enabled: true, ...}
        ckpt = ckpt.get("enabled", True)
    ckpt = str(CheckpointMode.parse(ckpt, sources["activation_checkpointing"]))

    clip = float(ds_section(ds, "gradient_clipping"))
    given = isinstance(ds, Mapping) and ds.get("gradient_clipping") is not None  # where it came from, for the report
    sources["gradient_clipping"] = "ds.gradient_clipping" if given else "default (as DeepSpeed)"
    # overlap_comm left unset stays None: "on for stage 3" then follows a stage the caller changes (--stage, the
    # tuner's space), where the schema has already settled it for the config's own stage
    buffers = BufferSettings.from_zero_config({**zero.model_dump(), "overlap_comm": zero.overlap_comm
                                               if "overlap_comm" in zero.model_fields_set else None})
    data_bytes, sources["data_bytes"] = data_pipeline_bytes(tree.get("data") or {})
    bf16 = ds_section(ds, "bf16")  # bf16 master state (docs/precision.md): only where a run keeps it
    low_masters = precision == "bf16" and bool(bf16.bf16_master_weights_and_grads)
    low_states = precision == "bf16" and bool(bf16.bf16_optimizer_states)
    if low_masters or low_states:
        sources["bf16_master_state"] = "ds.bf16.bf16_master_weights_and_grads / bf16_optimizer_states"
    fp16_masters = precision == "fp16" and bool(ds_section(ds, "fp16").fp16_master_weights_and_grads)
    if fp16_masters:
        sources["fp16_master_state"] = "ds.fp16.fp16_master_weights_and_grads"
    grad_accum = ds_section(ds, "data_types").grad_accum_dtype  # its accumulator, where not the stage's own
    if grad_accum is not None:
        sources["grad_accum_dtype"] = "ds.data_types.grad_accum_dtype"
    small = kept = kept_trainable = 0
    if model.module is not None:
        small = small_parameter_count(model.module, buffers.stage3_param_persistence_threshold)
        keep = ds_section(ds, "data_types").keep_in_fp32_modules
        kept, kept_trainable = kept_fp32_parameter_counts(model.module, keep, precision)
        if kept:
            sources["kept_fp32_params"] = "ds.data_types.keep_in_fp32_modules" + (" (auto: the model's lists)"
                                                                                 if keep == "auto" else "")
    inputs = EstimateInputs(
        total_params=model.counts.total, largest_layer_params=model.counts.largest_layer,
        trainable_params=model.counts.trainable, small_params=small,
        ranks_per_node=rpn, nodes=nodes, zero_stage=stage,
        offload_optimizer=str(zero.offload_optimizer.device).lower(),
        offload_param=str(zero.offload_param.device).lower(),
        precision=precision, optimizer=opt_type, optimizer_params=dict(optimizer.params),
        micro_batch_size=int(mbs), seq_len=int(seq), activation_checkpointing=ckpt,
        model_shape=model.shape, buffers=buffers, data_bytes=data_bytes,
        gradient_clipping=clip,
        gradient_accumulation_steps=gas or 1, sequence_parallel_size=sp,
        mics_shard_size=int(zero.mics_shard_size), hpz_partition_size=int(zero.zero_hpz_partition_size),
        bf16_master_weights_and_grads=low_masters, bf16_optimizer_states=low_states,
        fp16_master_weights_and_grads=fp16_masters, grad_accum_dtype=grad_accum,
        tensor_parallel_size=tp, unsplit_params=model.unsplit_params, zenflow=zero.zenflow,
        kept_fp32_params=kept, kept_fp32_trainable=kept_trainable)
    return inputs, sources
