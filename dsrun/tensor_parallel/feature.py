"""AutoTP training as a feature of the engine (:mod:`dsrun.features`), and DeepSpeed's ``tp_model_init``.

Built when ``tensor_parallel.autotp_size`` (or a ``deepspeed.tp_model_init(model, tp_size, dtype)`` call before
``initialize``) asks for more than one rank. It asks the topology for a ``model`` axis of that size
(``group_sizes``: DeepSpeed's layout, rank = data · M + model, so a tensor-parallel group is M consecutive
ranks), and when the groups are built (``take_topology``) it splits the model over the group, each rank cutting
its slices from the weights it holds (DeepSpeed's semantics: ranks whose weights differ train the model their
slices gather into), and then gives every parameter and buffer that stays whole the group's first rank's value
(DeepSpeed leaves those as each rank holds them, which lets the ranks of a group silently compute different
models). The split is the config's rules (``partition_config`` / ``preset_model``,
:func:`dsrun.tensor_parallel.spec_split.split_by_specs`), else by the model's Hugging Face ``tp_plan``
(:mod:`dsrun.tensor_parallel.hf_plan`), else its Transformer blocks read automatically
(:func:`dsrun.tensor_parallel.split.split_for_training`). ``tp_overlap_comm`` is set on the layers process-wide,
as DeepSpeed sets it. ZeRO (stages 0-3) then partitions and reduces over the data
group only: a split parameter's slice is its own on each rank, and every whole parameter gets the same
gradient on every rank of the group (the row-parallel all-reduce makes the activations equal, the
column-parallel backward all-reduce the activations' gradients). The checkpoint entries say how the model
was split (``tensor_parallel``) and DeepSpeed's ``mp_world_size``; each tensor-parallel rank writes its own
``mp_rank_XX`` files.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dsrun import comm
from dsrun.accelerator import get_accelerator
from dsrun.checkpoint.constants import (CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE,
                                        UNIVERSAL_CHECKPOINT_INFO)
from dsrun.comm.groups import ProcessGroups
from dsrun.config import DSConfig
from dsrun.features import Feature
from dsrun.inference.groups import TPGroup
from dsrun.moe.layer import MoE
from dsrun.utils.errors import ConfigError, Problem

from dsrun.zero.step_hooks import BEFORE_UPDATE

from .autotp_config import AutoTPConfig, partition_config_object
from .deepspeed_layers import set_autotp_mode
from .hf_plan import rules_from_hf_plan
from .layers import TensorParallelLinear, is_model_parallel_parameter
from .norm import clip_by_tensor_parallel_norm
from .shard_sizes import set_tp_grain_size
from .spec_split import split_by_specs
from .split import POLICY_KEY, TPLayout, set_keep_module_on_host, split_for_training, universal_checkpoint_info
from .vocab_parallel import split_vocabulary

# what deepspeed.tp_model_init recorded (DeepSpeed's _TP_MODEL_INIT_ARGS): merged into the config at initialize
_TP_MODEL_INIT_ARGS: dict[str, Any] | None = None
_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None, **kwargs: Any
                  ) -> nn.Module:
    """DeepSpeed's ``deepspeed.tp_model_init``: record the tensor-parallel degree (and dtype, and a ``tp_group``
    keyword) for the next ``initialize``, which splits the model; returns ``model`` unchanged. A second call must
    agree with the first; ``initialize`` refuses a config whose ``tensor_parallel.autotp_size`` or precision
    disagrees, and a ``tp_group`` that is not the rank's group of the topology. ``config`` and other keywords
    are not read (DeepSpeed's record-only ``tp_model_init`` does not read them either)."""
    global _TP_MODEL_INIT_ARGS
    recorded = {"tp_size": int(tp_size), "dtype": dtype, "tp_group": kwargs.get("tp_group")}
    previous = _TP_MODEL_INIT_ARGS
    if previous is not None and (previous["tp_size"], previous["dtype"]) != (recorded["tp_size"], dtype):
        raise ValueError("Conflicting tp_model_init arguments detected across multiple calls.")
    _TP_MODEL_INIT_ARGS = recorded
    return model


def refuse_group_beside_mpu(mpu: object) -> None:
    """DeepSpeed's rule for ``initialize(mpu=...)`` after ``tp_model_init(..., tp_group=...)``: the two name the
    tensor-parallel group twice, refused (a ValueError, as DeepSpeed raises)."""
    if mpu is not None and (_TP_MODEL_INIT_ARGS or {}).get("tp_group") is not None:
        raise ConfigError(Problem("initialize(mpu=...)", "tp_model_init provided tp_group; deepspeed.initialize must "
                                  "not receive mpu", "drop one of the two"))


def reset_tp_model_init() -> None:
    """Forget what ``tp_model_init`` recorded (DeepSpeed's tests set ``deepspeed._TP_MODEL_INIT_ARGS = None``)."""
    global _TP_MODEL_INIT_ARGS
    _TP_MODEL_INIT_ARGS = None


def autotp_degree(autotp_size: int) -> int:
    """The tensor-parallel degree a run trains with: the config's ``tensor_parallel.autotp_size``, else what
    ``tp_model_init`` recorded; 1 when neither asks for more. Two different sizes are a ConfigError."""
    recorded = _TP_MODEL_INIT_ARGS
    if recorded is None:
        return max(int(autotp_size), 1)
    if autotp_size and autotp_size != recorded["tp_size"]:
        raise ConfigError(Problem("tensor_parallel.autotp_size", f"is {autotp_size}, but deepspeed.tp_model_init("
                                  f"tp_size={recorded['tp_size']}) was called", "make them agree, or drop one"))
    return max(recorded["tp_size"], 1)


def _recorded_dtype_problems(config: DSConfig) -> list[Problem]:
    recorded = _TP_MODEL_INIT_ARGS
    wanted = next((dt for name, dt in _PRECISION_DTYPES.items() if getattr(config, name).enabled), None)
    if recorded is None or wanted is None or wanted == recorded["dtype"]:
        return []
    return [Problem("tensor_parallel", f"Conflicting dtype: config uses {wanted} but tp_model_init requested "
                    f"{recorded['dtype']}", "make them agree")]


_DTYPE_NAMES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _dtype_problems(config: DSConfig) -> list[Problem]:
    """``tensor_parallel.dtype``, when the config gives it: the dtype the split model trains in. DeepSpeed's engine
    casts the model by the precision section (fp16, bf16, else fp32) and refuses a ``tp_model_init`` dtype that
    disagrees with the key; a value the run would not train in is refused here rather than left unread."""
    section = config.tensor_parallel
    dtype = section.dtype
    if "dtype" not in section.model_fields_set:  # its default (fp16) is no request
        return []
    wanted = next((name for name in ("bf16", "fp16") if getattr(config, name).enabled), "fp32")
    problems = []
    if dtype != wanted:
        hint = "drop the key" if wanted != "fp32" else f"enable the {dtype} section, or drop the key"
        problems.append(Problem("tensor_parallel.dtype", f"is {dtype}, but the run trains the split model in "
                                f"{wanted} (the precision section casts the model, as DeepSpeed's engine does)",
                                f"set it to {wanted}; or {hint}"))
    recorded = _TP_MODEL_INIT_ARGS
    if recorded is not None and recorded["dtype"] != _DTYPE_NAMES[dtype]:
        problems.append(Problem("tensor_parallel.dtype", f"Conflicting tensor_parallel.dtype in config "
                                f"({dtype}) and tp_model_init ({recorded['dtype']})", "make them agree"))
    return problems


GROUP_KEY, MPU_KEY = "tensor_parallel.tp.tp_group", "tensor_parallel.tp.mpu"


def _given_group(config: DSConfig) -> tuple[object, str | None, list[Problem]]:
    """The tensor-parallel group the caller gives, with the name it was given under: the config's
    ``tensor_parallel.tp.tp_group``, the model-parallel group of its ``tensor_parallel.tp.mpu``
    (``get_model_parallel_group()``, as DeepSpeed's AutoTP reads an mpu), or ``tp_model_init(tp_group=...)``;
    (None, None) when none is. DeepSpeed's conflicts are refused: a group beside an mpu, two different groups."""
    tp = config.tensor_parallel.tp
    recorded = (_TP_MODEL_INIT_ARGS or {}).get("tp_group")
    problems = []
    if tp.mpu is not None and (tp.tp_group is not None or recorded is not None):
        problems.append(Problem(MPU_KEY, "is given beside a tp_group (tensor_parallel.tp.tp_group or tp_model_init's)",
                                "give the tensor-parallel group once: the group, or the mpu"))
    if tp.tp_group is not None and recorded is not None and tp.tp_group is not recorded:
        problems.append(Problem(GROUP_KEY, "Conflicting tensor_parallel.tp.tp_group in config and tp_model_init",
                                "pass the same group to both, or to one"))
    if tp.mpu is not None and not callable(getattr(tp.mpu, "get_model_parallel_group", None)):
        problems.append(Problem(MPU_KEY, f"a {type(tp.mpu).__name__} has no get_model_parallel_group()",
                                "pass a model-parallel unit with DeepSpeed's mpu getters, or "
                                "tensor_parallel.tp.tp_group"))
    if problems:
        return None, None, problems
    if tp.tp_group is not None:
        return tp.tp_group, GROUP_KEY, []
    if tp.mpu is not None:
        return tp.mpu.get_model_parallel_group(), MPU_KEY, []
    if recorded is not None:
        return recorded, "tp_model_init(tp_group=...)", []
    return None, None, []


def _members(group: object) -> list[int] | None:
    """The global ranks of ``group`` in its order (None when it is not a process group of this world)."""
    try:
        return [comm.get_global_rank(group, r) for r in range(comm.get_world_size(group))]
    except (RuntimeError, ValueError, TypeError, AttributeError):
        return None


def _policy_rows(value: Sequence[object] | str | None) -> tuple[tuple[str, ...] | None, list[Problem]]:
    if value is None:
        return None, []
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names or not all(isinstance(name, str) and name for name in names):
        return None, [Problem(POLICY_KEY, f"got {value!r}; expected the names of each block's row-parallel linears",
                              "e.g. [\"attn.c_proj\", \"mlp.c_proj\"]")]
    return names, []


class AutoTPFeature(Feature):
    name = "autotp"

    def __init__(self, config: DSConfig, size: int, rules: AutoTPConfig | None = None, given: object = None,
                 given_as: str | None = None, rows: tuple[str, ...] | None = None):
        self.size = size
        self.rules = rules  # partition_config / preset_model: split by these rules, not automatically
        self.given, self.given_as = given, given_as  # the caller's tensor-parallel group, and the key it came by
        self.given_mpu = config.tensor_parallel.tp.mpu if given_as == MPU_KEY else None
        self.rows = rows  # injection_policy_tuple: each block's row-parallel linears
        self.clipping = float(config.gradient_clipping or 0.0)
        self.grain = int(config.tensor_parallel.tp.tp_grain_size)  # the cut of what is not attention
        self.vocab_parallel = bool(config.tensor_parallel.vocab_parallel_lm_head)
        self._group: Any = None
        self._source = 0  # the global rank of the group's first rank
        self._input_check: Any = None
        self.layout: TPLayout | None = None
        self.uc_info: dict[str, Any] = {}  # the split model's universal_checkpoint_info (take_topology)

    @classmethod
    def build(cls, config: DSConfig) -> "AutoTPFeature | None":
        size = autotp_degree(int(config.tensor_parallel.autotp_size))
        problems = _recorded_dtype_problems(config) + _dtype_problems(config)
        section = config.tensor_parallel
        overlap, grain = bool(section.tp_overlap_comm), int(section.tp.tp_grain_size)
        keep_on_host = bool(section.keep_module_on_host)
        rules = partition_config_object(section.partition_config, section.preset_model, size)
        given, given_as, group_problems = _given_group(config)
        rows, row_problems = _policy_rows(section.injection_policy_tuple)
        problems += group_problems + row_problems
        if rows is not None and rules is not None:
            problems.append(Problem(POLICY_KEY, "names the row-parallel linears beside partition_config / "
                                    "preset_model's rules", "split by one of them"))
        if size > 1 or _TP_MODEL_INIT_ARGS is not None:  # as DeepSpeed's initialize: AutoTP is for training now
            set_autotp_mode(training=True)
            TensorParallelLinear.overlap_comm = overlap
            set_tp_grain_size(grain)  # process-wide, as DeepSpeed sets it
            set_keep_module_on_host(keep_on_host)  # process-wide too (DeepSpeed's AutoTP sets it)
        if section.tp.tp_size not in (1, size):
            problems.append(Problem("tensor_parallel.tp.tp_size", f"is {section.tp.tp_size}, but the "
                                    f"tensor-parallel degree is {size}", "leave it out, or make it autotp_size"))
        vocab_parallel = bool(section.vocab_parallel_lm_head)
        if size <= 1:
            if vocab_parallel:
                problems.append(Problem("tensor_parallel.vocab_parallel_lm_head", "cuts the vocabulary over the "
                                        "tensor-parallel ranks, and autotp_size asks for none", "set autotp_size"))
            if problems:
                raise ConfigError(problems)
            return None
        if int(config.sequence_parallel_size) > 1:
            problems.append(Problem("sequence_parallel_size", "AutoTP training with Ulysses sequence parallelism "
                                    "is not built", "use one of the two"))
        if problems:
            raise ConfigError(problems)
        return cls(config, size, rules, given, given_as, rows)

    def group_sizes(self) -> dict[str, int]:
        return {"model": self.size}

    def take_topology(self, model: nn.Module, groups: ProcessGroups) -> None:  # type: ignore[override]
        if groups.size("model") != self.size:  # a client mpu brought a data-parallel group only
            raise ConfigError(Problem("tensor_parallel.autotp_size", f"is {self.size}, but the run's groups have "
                                      f"a model axis of {groups.size('model')} (a client mpu's)",
                                      "drop mpu=, so dsrun builds the tensor-parallel groups from the world"))
        if any(isinstance(m, MoE) for m in model.modules()):
            raise ConfigError(Problem("tensor_parallel.autotp_size", "AutoTP training of a model with MoE layers is "
                                      "not built (its experts are not split)", "drop tensor_parallel or the MoE layers"))
        group, members = self._split_group(groups)
        # what every rank of the group holds whole before the split (a slice split already is its own)
        whole = {id(t) for t in list(model.parameters()) + list(model.buffers()) if not is_model_parallel_parameter(t)}
        self._group, self._source = group, members[0]
        self._input_check = model.register_forward_pre_hook(self._check_inputs_agree, with_kwargs=True)
        rank = groups.coord("model")
        vocabulary = TPLayout(self.size, rank)
        if self.vocab_parallel:  # first: the rules then leave the cut head and embedding as they are
            split_vocabulary(model, group, TPGroup(group, rank, self.size), self.grain, vocabulary)
        rules, source = self.rules, "tensor_parallel.partition_config"
        if rules is None and self.rows is None:  # DeepSpeed's order: the config's rules (partition_config or the
            # injection policy), the model's plan, the automatic reading
            rules, source = rules_from_hf_plan(model, self.size), "the model's Hugging Face tp_plan"
        self.layout = (split_for_training(model, group, rank, self.size, self.grain, self.rows) if rules is None
                       else split_by_specs(model, rules, group, rank, self.size, source, self.grain))
        # DeepSpeed cuts each rank's slices from the weights that rank holds (its engine broadcasts over the data
        # group only); what stays whole is made the group's first rank's, so the group computes one model: the
        # one its slices gather into (gather_params, the checkpoint's merge)
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                if id(tensor) in whole and not is_model_parallel_parameter(tensor):
                    comm.broadcast(tensor.data, src=members[0], group=group)
        self.layout.splits.update(vocabulary.splits)
        self.layout.whole.update(vocabulary.whole)
        self.uc_info = universal_checkpoint_info(model, self.layout)
        setattr(model, UNIVERSAL_CHECKPOINT_INFO, self.uc_info)

    def _split_group(self, groups: ProcessGroups) -> tuple[object, list[int]]:
        """The group the split communicates over, and its ranks: the caller's (``tensor_parallel.tp.tp_group``,
        ``tp.mpu``'s, ``tp_model_init``'s), which must hold exactly this rank's tensor-parallel ranks of the
        topology (and an mpu's data-parallel group its data-parallel ranks), else the topology's own. The ranks
        agree before any refuses, so that none waits in the split's collectives for one that stopped."""
        members = groups.members("model")
        if self.given is None:
            return groups.model, members
        problem = None
        held = _members(self.given)
        if held != members:
            what = "is not a process group of this world" if held is None else f"holds ranks {held}"
            problem = Problem(self.given_as or GROUP_KEY, f"this rank's group {what}, not its tensor-parallel group "
                              f"{members} (dsrun's layout: {self.size} consecutive ranks)",
                              f"pass the group of ranks {members}, or leave it out: dsrun builds the groups")
        mpu = self.given_mpu
        if problem is None and mpu is not None and callable(getattr(mpu, "get_data_parallel_group", None)):
            data = _members(mpu.get_data_parallel_group())
            if data != groups.members("data"):
                problem = Problem(MPU_KEY, f"its data-parallel group holds ranks {data}, not this rank's data-parallel "
                                  f"ranks {groups.members('data')}", "give the mpu of dsrun's layout, or only its "
                                  "tensor-parallel group as tensor_parallel.tp.tp_group")
        agree = torch.tensor([0.0 if problem else 1.0], device=get_accelerator().current_device_name())
        comm.all_reduce(agree, op=comm.ReduceOp.MIN)
        if problem is not None:
            raise ConfigError(problem)
        if not agree.item():
            raise ConfigError(Problem(self.given_as or GROUP_KEY, "another rank's tensor-parallel group is not its "
                                      "group of the topology", "see that rank's error"))
        return self.given, members

    def _check_inputs_agree(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The first forward: the ranks of a tensor-parallel group must read the same batch (DeepSpeed's check,
        its message; every rank of the group raises)."""
        self._input_check.remove()
        tensors = [t.detach() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        layouts: list[Any] = [None] * self.size  # shapes first: a broadcast needs the same shape on every rank
        comm.all_gather_object(layouts, [(tuple(t.shape), str(t.dtype)) for t in tensors], group=self._group)
        same = all(layout == layouts[0] for layout in layouts)
        if same:
            agree = torch.ones(1, device=tensors[0].device if tensors else None)
            for tensor in tensors:
                first = tensor.clone().contiguous()
                comm.broadcast(first, src=self._source, group=self._group)
                agree *= float(torch.equal(first, tensor))
            comm.all_reduce(agree, op=comm.ReduceOp.MIN, group=self._group)
            same = bool(agree.item())
        if not same:
            raise AssertionError("Data inconsistency within the TP group. Please check the Dataloader "
                                 "implementation to ensure consistency.")

    def attach(self, engine: Any) -> None:
        """Gradient clipping by the unsplit model's norm (dsrun/tensor_parallel/norm.py)."""
        if engine.strategy is not None and self.clipping:
            engine.strategy.hooks.add(BEFORE_UPDATE, lambda state: clip_by_tensor_parallel_norm(
                state, self._group, self.clipping))

    def checkpoint_entries(self) -> dict[str, Any]:
        assert self.layout is not None
        # DeepSpeed's entries too: the model's universal_checkpoint_info and the degrees its checkpoint readers take
        return {"mp_world_size": self.size, UNIVERSAL_CHECKPOINT_INFO: self.uc_info,
                CHECKPOINT_PARALLEL_DIMS: {CHECKPOINT_PP_DEGREE: 1, CHECKPOINT_TP_DEGREE: self.size},
                "dsrun": {"tensor_parallel": self.layout.entry()}}
