"""``optimizer`` and ``scheduler`` sections, and the checks on their ``params``.

``optimizer.params`` is an open dict (constructor keyword arguments); only the common keys are
type-checked (``lr``, ``betas``, ``eps``, ``weight_decay``). An optimizer ``type`` is one of DeepSpeed's
native names (case-insensitive) or a class in ``torch.optim`` (case-sensitive, as DeepSpeed looks it up).

``scheduler.type`` is one of DeepSpeed's five schedules or a class in ``torch.optim.lr_scheduler``. For the
five DeepSpeed schedules the ``params`` are their constructor's keyword arguments, so a misspelled name
(which DeepSpeed would turn into a TypeError at initialize) is reported with a suggestion, and the required
ones (``total_num_steps`` for the decay schedules, ``cycle_min_lr``/``cycle_max_lr`` for OneCycle) are
enforced.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from dsrun.utils.errors import Problem, show
from dsrun.utils.suggest import did_you_mean

from .base import NonNegInt, OpenDict, Section
from .problems import validate_model

# DeepSpeed's own optimizers, compared lower-cased (config-keys.md §4.1 and v0.14.3).
NATIVE_OPTIMIZERS = {
    "adam": "Adam", "adamw": "AdamW", "lamb": "Lamb", "onebitadam": "OneBitAdam",
    "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb", "adagrad": "Adagrad", "lion": "Lion",
    "muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD", "muon": "Muon",
}
ONE_BIT_OPTIMIZERS = frozenset({"onebitadam", "zerooneadam", "onebitlamb"})
DYNAMIC_LOSS_SCALE_OPTIMIZERS = frozenset({"lamb", "onebitlamb"})
# Optimizers ZeRO is tested with (DeepSpeed asserts unless zero_allow_untested_optimizer is set).
ZERO_TESTED_OPTIMIZERS = frozenset({"adam", "adamw", "lamb", "adagrad", "lion", "muon"})

DEEPSPEED_SCHEDULERS = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


class OptimizerConfig(Section):
    """``optimizer``: ``type`` (native DeepSpeed name or a ``torch.optim`` class) and ``params`` (open dict
    of constructor keyword arguments). ``legacy_fusion`` is undocumented but read by DeepSpeed."""

    type: str | None = None
    params: OpenDict = Field(default_factory=dict)
    legacy_fusion: bool = False

    @property
    def name(self) -> str | None:
        """The type lower-cased when it is a DeepSpeed optimizer (as DeepSpeed stores it), else as given."""
        if self.type is None:
            return None
        return self.type.lower() if self.type.lower() in NATIVE_OPTIMIZERS else self.type

    @property
    def is_native(self) -> bool:
        return self.type is not None and self.type.lower() in NATIVE_OPTIMIZERS


class SchedulerConfig(Section):
    """``scheduler``: ``type`` and ``params`` (keyword arguments of the scheduler's constructor).
    DeepSpeed steps the scheduler at every training step, inside ``engine.step()``."""

    type: str | None = None
    params: OpenDict = Field(default_factory=dict)


# --- params schemas, used only to check params (the config keeps params as a plain dict) -------------

Number = float
LrValue = float | list[float]  # DeepSpeed schedules accept one value or one per parameter group
WarmupType = Literal["log", "linear"]


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")
    last_batch_iteration: int = -1


class LRRangeTestParams(_Params):
    lr_range_test_min_lr: LrValue = 0.001
    lr_range_test_step_size: NonNegInt = 2000
    lr_range_test_step_rate: Number = 1.0
    lr_range_test_staircase: bool = False


class OneCycleParams(_Params):
    cycle_min_lr: Number
    cycle_max_lr: Number
    decay_lr_rate: Number = 0.0
    cycle_first_step_size: Annotated[int, Field(ge=1)] = 2000
    cycle_second_step_size: Annotated[int, Field(ge=1)] | None = None
    cycle_first_stair_count: NonNegInt = 0
    cycle_second_stair_count: NonNegInt | None = None
    decay_step_size: NonNegInt = 0
    cycle_momentum: bool = True
    cycle_min_mom: Number = 0.8
    cycle_max_mom: Number = 0.9
    decay_mom_rate: Number = 0.0


class WarmupLRParams(_Params):
    warmup_min_lr: LrValue = 0.0
    warmup_max_lr: LrValue | None = None  # each param group's optimizer lr (DeepSpeed 0.19; 0.14: 0.001)
    warmup_num_steps: NonNegInt = 1000
    warmup_type: WarmupType = "log"


class WarmupDecayLRParams(WarmupLRParams):
    total_num_steps: Annotated[int, Field(ge=1)]
    warmup_max_lr: LrValue = 0.001  # DeepSpeed 0.19's WarmupDecayLR still defaults to 0.001


class WarmupCosineLRParams(_Params):
    total_num_steps: Annotated[int, Field(ge=1)]
    warmup_min_ratio: Number = 0.0
    warmup_num_steps: NonNegInt = 1000
    cos_min_ratio: Number = 0.0001
    warmup_type: WarmupType = "log"


SCHEDULER_PARAMS: dict[str, type[_Params]] = {
    "LRRangeTest": LRRangeTestParams,
    "OneCycle": OneCycleParams,
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
}


class _CommonOptimizerParams(BaseModel):
    """Types of the keys every optimizer shares; other keys pass through unchecked."""

    model_config = ConfigDict(extra="allow")
    lr: Annotated[float, Field(ge=0)] | None = None
    betas: tuple[float, float] | None = None
    eps: Annotated[float, Field(ge=0)] | None = None
    weight_decay: Annotated[float, Field(ge=0)] | None = None


# The 1-bit optimizers' params are their constructors' keyword arguments (dsrun/optim/onebit, where the
# defaults live); listed here so `dsrun config --validate` names a misspelt one. comm_backend_name takes
# DeepSpeed's names, each mapped onto dsrun's compressed all-reduce over the run's backend.
ONE_BIT_BACKENDS = ("nccl", "mpi", "compressed", "hccl")
PositiveInt = Annotated[int, Field(ge=1)]


class _OneBitParams(_CommonOptimizerParams):
    model_config = ConfigDict(extra="forbid")
    bias_correction: bool | None = None
    eps_inside_sqrt: bool | None = None
    max_grad_norm: Annotated[float, Field(ge=0)] | None = None
    amsgrad: bool | None = None
    cuda_aware: bool | None = None
    comm_backend_name: Literal["nccl", "mpi", "compressed", "hccl", "NCCL", "MPI", "COMPRESSED", "HCCL"] | None = None


class OneBitAdamParams(_OneBitParams):
    freeze_step: PositiveInt | None = None


class ZeroOneAdamParams(_OneBitParams):
    var_freeze_step: PositiveInt | None = None
    var_update_scaler: PositiveInt | None = None
    local_step_scaler: PositiveInt | None = None
    local_step_clipper: PositiveInt | None = None


class OneBitLambParams(_OneBitParams):
    freeze_step: PositiveInt | None = None
    max_coeff: Annotated[float, Field(gt=0)] | None = None
    min_coeff: Annotated[float, Field(gt=0)] | None = None
    coeff_beta: Annotated[float, Field(ge=0, lt=1)] | None = None
    factor_max: Annotated[float, Field(gt=0)] | None = None
    factor_min: Annotated[float, Field(gt=0)] | None = None
    factor_threshold: Annotated[float, Field(ge=0)] | None = None


# OnebitLamb's defaults for the params its pair rules compare (DeepSpeed's; the constructor's signature holds
# the same values, tests/unit/runtime pins that they agree)
ONE_BIT_LAMB_DEFAULTS: dict[str, float] = {"freeze_step": 100000, "coeff_beta": 0.9, "max_coeff": 10.0,
                                           "min_coeff": 0.01, "factor_max": 4.0, "factor_min": 0.5}


def lamb_pair_problems(values: dict[str, float | None], base: str) -> list[Problem]:
    """The rules between 1-bit LAMB's params, on the values it will run with (a missing one is its default):
    one set of rules for ``dsrun config --validate`` and the optimizer's constructor."""
    defaulted = {key for key in ONE_BIT_LAMB_DEFAULTS if values.get(key) is None}
    v = {key: ONE_BIT_LAMB_DEFAULTS[key] if key in defaulted else values[key] for key in ONE_BIT_LAMB_DEFAULTS}

    def shown(key: str) -> str:
        return f"{key} {v[key]:g}" + (" by default" if key in defaulted else "")

    problems = []
    for low, high in (("min_coeff", "max_coeff"), ("factor_min", "factor_max")):
        if not 0 < v[low] <= v[high]:
            problems.append(Problem(f"{base}.{low}", f"got {shown(low)}, {shown(high)}", f"expected 0 < {low} <= {high}"))
    beta, freeze = v["coeff_beta"], v["freeze_step"]
    if 0 <= beta < 1 and freeze * (1 - beta) < 1 - 1e-9:
        problems.append(Problem(f"{base}.coeff_beta", f"1 / (1 - coeff_beta) = {1 / (1 - beta):g} exceeds freeze_step "
                                f"{freeze} ({shown('coeff_beta')}): the frozen coefficient would still be biased "
                                "towards 0", "lower coeff_beta or raise freeze_step"))
    return problems


# the optimizer types the engine builds as one of DeepSpeed's CPU optimizers (DeepSpeedCPUAdam/Adagrad/Lion) when
# the optimizer is offloaded (Adam/AdamW unless their params ask for torch_adam)
CPU_OPTIMIZER_TYPES = ("adam", "adamw", "adagrad", "lion")
MUON_OPTIMIZER_NAMES = ("muon", "muonwithauxadam")  # optimizer.type, and the class the engine builds


def offload_optimizer_problem(optimizer_name: str, device: str, force_ds_cpu_optimizer: bool,
                              prefix: str = "") -> Problem | None:
    """The problem with offloading (ZeRO-Offload to ``device``) an optimizer that is not one of DeepSpeed's CPU
    optimizers, else None: one rule for the config check (on ``optimizer.type``) and the engine (on the optimizer
    it built or was given). Muon, which DeepSpeed builds from the config and steps on the host, offloads to the
    CPU and (ZeRO-3) to NVMe, whose swapped step applies its updates tile by tile (dsrun/optim/muon/zero.py)."""
    if optimizer_name.lower() in MUON_OPTIMIZER_NAMES and device in ("cpu", "nvme"):
        return None
    if device == "nvme":
        return Problem(f"{prefix}zero_optimization.offload_optimizer.device", "NVMe optimizer offload steps swapped "
                       f"tiles with a DeepSpeed CPU optimizer; got {optimizer_name}",
                       "use optimizer type Adam, AdamW, Adagrad or Lion")
    if force_ds_cpu_optimizer:
        return Problem(f"{prefix}zero_force_ds_cpu_optimizer", "ZeRO-Offload needs DeepSpeedCPUAdam, "
                       f"DeepSpeedCPUAdagrad or DeepSpeedCPULion; got {optimizer_name}",
                       "use optimizer type Adam, AdamW, Adagrad or Lion, or set \"zero_force_ds_cpu_optimizer\": "
                       "false to step it on the host anyway")
    return None


class MuonParams(_CommonOptimizerParams):
    """Muon's params as DeepSpeed's engine reads them (dsrun/optim/muon/optimizer.py: ``muon_param_groups``);
    DeepSpeed drops any other key silently, dsrun names it."""

    model_config = ConfigDict(extra="forbid")
    muon_lr: Annotated[float, Field(ge=0)] | None = None
    adam_lr: Annotated[float, Field(ge=0)] | None = None
    momentum: Annotated[float, Field(ge=0, lt=1)] | None = None
    ns_method: Literal["gram", "standard"] | None = None


ONE_BIT_PARAMS: dict[str, type[_OneBitParams]] = {"onebitadam": OneBitAdamParams, "zerooneadam": ZeroOneAdamParams,
                                                  "onebitlamb": OneBitLambParams}


@lru_cache(maxsize=None)
def _torch_names(module: str) -> frozenset[str]:
    """Public class names in a torch module; imported lazily so plain validation stays fast."""
    import importlib

    mod = importlib.import_module(module)
    return frozenset(n for n in dir(mod) if not n.startswith("_") and isinstance(getattr(mod, n), type))


def torch_signature_problems(module: str, name: str, params: dict, base: str) -> list[Problem]:
    """``params`` against the constructor of ``module.name`` (a torch optimizer or scheduler, whose first
    argument the engine passes): keys it does not take, and arguments without a default that are missing.
    The engine would get the same TypeError from the constructor; this finds it before any rank starts."""
    import importlib
    import inspect

    try:
        signature = inspect.signature(getattr(importlib.import_module(module), name))
    except (AttributeError, TypeError, ValueError):
        return []
    arguments = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    named = {p.name: p for p in arguments[1:]}  # the first is the params / the optimizer
    problems = []
    if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        problems += [Problem(f"{base}.{key}", f"is not an argument of {module}.{name}; allowed: {', '.join(named)}",
                             did_you_mean(key, named)) for key in params if key not in named]
    problems += [Problem(f"{base}.{key}", f"required key is missing ({module}.{name} has no default for it)")
                 for key, p in named.items() if p.default is p.empty and key not in params]
    return problems


def check_optimizer(optimizer: OptimizerConfig, prefix: str) -> list[Problem]:
    """Problems with ``optimizer.type`` and the common ``optimizer.params``."""
    problems: list[Problem] = []
    base = f"{prefix}optimizer"
    if optimizer.type is not None and not optimizer.is_native:
        torch_names = _torch_names("torch.optim")
        if optimizer.type not in torch_names or optimizer.type in ("Optimizer",):
            choices = list(NATIVE_OPTIMIZERS.values()) + sorted(n for n in torch_names if n[0].isupper())
            problems.append(Problem(
                f"{base}.type",
                f"got {show(optimizer.type)}; allowed: a DeepSpeed optimizer ({', '.join(NATIVE_OPTIMIZERS.values())}, "
                "case-insensitive) or a torch.optim class name",
                did_you_mean(optimizer.type, NATIVE_OPTIMIZERS.values()) or did_you_mean(optimizer.type, choices),
            ))
        else:  # a torch.optim class: its constructor's arguments
            problems += torch_signature_problems("torch.optim", optimizer.type, optimizer.params, f"{base}.params")
    if optimizer.type is None and optimizer.params:
        problems.append(Problem(f"{base}.type", "required key is missing (params are given without a type)",
                                "add e.g. \"type\": \"AdamW\""))
    params_model = ONE_BIT_PARAMS.get((optimizer.type or "").lower(), _CommonOptimizerParams)
    if (optimizer.type or "").lower() == "muon":
        params_model = MuonParams
    params, params_problems = validate_model(params_model, optimizer.params, f"{base}.params")
    problems.extend(params_problems)
    if isinstance(params, _OneBitParams):
        problems.extend(_one_bit_rules(params, optimizer.type or "", f"{base}.params"))
    return problems


def _one_bit_rules(params: _OneBitParams, name: str, base: str) -> list[Problem]:
    """The rules between a 1-bit optimizer's params that its constructor enforces, checked before launch on
    the values it will run with (for 1-bit LAMB the same function as its constructor's)."""
    problems = []
    if params.amsgrad:
        problems.append(Problem(f"{base}.amsgrad", f"got true; {name} has no AMSGrad variant (as in DeepSpeed)",
                                "remove it"))
    if params.max_grad_norm:
        problems.append(Problem(f"{base}.max_grad_norm", f"got {show(params.max_grad_norm)}; {name} does not clip "
                                "by itself", "clip with the top-level \"gradient_clipping\" instead"))
    if isinstance(params, OneBitLambParams):
        problems.extend(lamb_pair_problems({key: getattr(params, key) for key in ONE_BIT_LAMB_DEFAULTS}, base))
    return problems


def check_scheduler(scheduler: SchedulerConfig, prefix: str) -> list[Problem]:
    """Problems with ``scheduler.type`` and, for DeepSpeed's schedules, ``scheduler.params``."""
    base = f"{prefix}scheduler"
    if scheduler.type is None:
        if scheduler.params:
            return [Problem(f"{base}.type", "required key is missing (params are given without a type)",
                            f"one of {', '.join(DEEPSPEED_SCHEDULERS)}")]
        return []
    params_model = SCHEDULER_PARAMS.get(scheduler.type)
    if params_model is not None:
        return validate_model(params_model, scheduler.params, f"{base}.params")[1]
    torch_names = _torch_names("torch.optim.lr_scheduler")
    if scheduler.type in torch_names and scheduler.type not in ("LRScheduler", "_LRScheduler"):
        return torch_signature_problems("torch.optim.lr_scheduler", scheduler.type, scheduler.params,
                                        f"{base}.params")
    return [Problem(
        f"{base}.type",
        f"got {show(scheduler.type)}; allowed: {', '.join(DEEPSPEED_SCHEDULERS)} or a torch.optim.lr_scheduler "
        "class name (case-sensitive)",
        did_you_mean(scheduler.type, list(DEEPSPEED_SCHEDULERS) + sorted(torch_names)),
    )]
