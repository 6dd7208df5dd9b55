"""The search space: which overrides a trial gets, its experiment name and its global batch.

A configuration is ``{key: value}`` over the space's keys (DeepSpeed keys without ``ds.``, RunSpec keys such
as ``data.seq_len`` as written). Keys with one value are fixed; the others are the tuned dimensions.
``fast`` mode (``ds.autotuning.fast``) keeps only the ZeRO stage and the micro batch size, as DeepSpeed's
fast mode does; every other key keeps the recipe's value.

Experiment names follow DeepSpeed's ``z{stage}_gas{gas}_tmbspg{mbs}``, with the other tuned keys in between
as the initials of their last word plus the value (``z2_oc_T_rbs5.0e+08_gas1_tmbspg4`` style:
``overlap_comm=True`` → ``ocT``, numbers above 9000 as ``5.0e+08``).
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from dsrun.autotuning.settings import SpaceValue, TuneSettings
from dsrun.config import ds_section
from dsrun.utils.errors import Problem, UserError

if TYPE_CHECKING:
    from optuna.trial import Trial

STAGE_KEY = "zero_optimization.stage"
MICRO_BATCH_KEY = "train_micro_batch_size_per_gpu"
ACCUMULATION_KEY = "gradient_accumulation_steps"
FAST_KEYS = (STAGE_KEY, MICRO_BATCH_KEY)
RUNSPEC_HEADS = ("model", "data", "train", "launcher")


def canonical_key(key: str) -> str:
    """``ds.zero_optimization.stage`` → ``zero_optimization.stage``; RunSpec keys stay as they are."""
    return key[3:] if key.startswith("ds.") else key


def override_key(key: str) -> str:
    """The Hydra key a trial sets for a space key: DeepSpeed keys live under ``ds.``."""
    return key if key.split(".")[0] in RUNSPEC_HEADS else f"ds.{key}"


def hydra_value(value: SpaceValue) -> str:
    """A value as Hydra's override grammar reads it back unchanged."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    return text if re.fullmatch(r"[A-Za-z_][\w\-./]*", text) else "'" + text.replace("'", "\\'") + "'"


def _name_value(value: SpaceValue) -> str:
    if isinstance(value, bool):
        return "T" if value else "F"
    if isinstance(value, (int, float)) and abs(value) > 9000:
        return f"{value:.1e}"
    return re.sub(r"[^\w.+\-]", "-", str(value))


def _initials(key: str) -> str:
    return "".join(word[:1] for word in key.split(".")[-1].split("_") if word)


def micro_batch_candidates(settings: TuneSettings, accumulation: int, data_parallel_size: int) -> list[int]:
    """Without a list in the space: ``num_tuning_micro_batch_sizes`` powers of two from
    ``min_train_micro_batch_size_per_gpu``, at most ``max_train_micro_batch_size_per_gpu`` and what
    ``max_train_batch_size`` allows over the ``data_parallel_size`` ranks that take different samples (DeepSpeed:
    ``max_train_batch_size * mp_size // gpus``)."""
    top = settings.max_micro_batch
    if settings.max_train_batch_size:
        top = min(top, settings.max_train_batch_size // (accumulation * data_parallel_size))
    sizes = [settings.min_micro_batch * 2**i for i in range(settings.num_tuning_micro_batch_sizes)]
    return [m for m in sizes if m <= top] or [settings.min_micro_batch]


def batch_size_bound(settings: TuneSettings, train_batch_size: int) -> str | None:
    """Why a configuration of global batch ``train_batch_size`` is pruned before launch (outside
    ``max_train_batch_size`` / ``min_train_batch_size``), or None."""
    if settings.max_train_batch_size and train_batch_size > settings.max_train_batch_size:
        return f"train batch size {train_batch_size} > max_train_batch_size {settings.max_train_batch_size}"
    if train_batch_size < settings.min_train_batch_size:
        return f"train batch size {train_batch_size} < min_train_batch_size {settings.min_train_batch_size}"
    return None


@dataclass(frozen=True)
class SearchSpace:
    dims: dict[str, list[Any]]  # tuned keys, in the order written
    fixed: dict[str, Any]  # keys with one value
    base: dict[str, Any]  # the recipe's stage / micro batch / accumulation, for names and batch sizes
    world_size: int
    ignored: tuple[str, ...] = ()  # keys fast mode left at the recipe's value
    mp_size: int = 1  # autotuning.mp_size: ranks that share one model replica

    @property
    def data_parallel_size(self) -> int:
        """The ranks that take different samples: ``world_size / mp_size`` (DeepSpeed's autotuner)."""
        return self.world_size // self.mp_size

    @property
    def size(self) -> int:
        count = 1
        for values in self.dims.values():
            count *= len(values)
        return count

    def grid(self) -> Iterator[dict[str, Any]]:
        for combo in itertools.product(*self.dims.values()):
            yield dict(zip(self.dims, combo))

    def is_ordered(self, key: str) -> bool:
        """Numbers (not booleans): the samplers see their rank, so a model-based sampler can learn trends
        (micro batch 4 did well, so 8 may too) instead of unrelated categories."""
        return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in self.dims[key])

    def choices(self, key: str) -> list[Any]:
        """A dimension's values in the order the samplers index them (ascending for numbers)."""
        return sorted(self.dims[key]) if self.is_ordered(key) else list(self.dims[key])

    def sampler_space(self) -> dict[str, list[Any]]:
        """What Optuna sees: the index of each ordered dimension's value, the values of the others."""
        return {k: list(range(len(v))) if self.is_ordered(k) else list(v) for k, v in self.dims.items()}

    def suggest(self, trial: Trial) -> dict[str, Any]:
        """Sample one configuration's tuned values through an Optuna trial."""
        params = {}
        for key in self.dims:
            if self.is_ordered(key):
                params[key] = self.choices(key)[trial.suggest_int(key, 0, len(self.dims[key]) - 1)]
            else:
                params[key] = trial.suggest_categorical(key, self.dims[key])
        return params

    def decode(self, sampled: Mapping[str, Any]) -> dict[str, Any]:
        """An Optuna trial's ``params`` (indices for ordered dimensions) as values."""
        return {k: self.choices(k)[int(v)] if k in self.dims and self.is_ordered(k) else v
                for k, v in sampled.items()}

    def config(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The full configuration of a trial: fixed keys, then the sampled ones."""
        return {**self.fixed, **params}

    def value(self, config: Mapping[str, Any], key: str) -> Any:
        return config.get(key, self.base.get(key))

    def train_batch_size(self, config: Mapping[str, Any]) -> int:
        return int(self.value(config, MICRO_BATCH_KEY)) * int(self.value(config, ACCUMULATION_KEY) or 1) \
            * self.data_parallel_size

    def experiment_name(self, config: Mapping[str, Any]) -> str:
        extras = [f"{_initials(k)}{_name_value(v)}" for k, v in config.items()
                  if k in self.dims and k not in (STAGE_KEY, MICRO_BATCH_KEY, ACCUMULATION_KEY)]
        return "_".join([f"z{self.value(config, STAGE_KEY)}", *extras,
                         f"gas{self.value(config, ACCUMULATION_KEY) or 1}",
                         f"tmbspg{self.value(config, MICRO_BATCH_KEY)}"])

    def tuning_space_of(self, config: Mapping[str, Any]) -> str:
        """DeepSpeed's per-stage tuning space name, ``z0`` … ``z3``."""
        return f"z{self.value(config, STAGE_KEY)}"

    def overrides(self, config: Mapping[str, Any], arg_mappings: Mapping[str, str] | None = None) -> list[str]:
        """``dsrun train`` overrides for ``config``; ``train_batch_size`` follows micro batch x
        accumulation x ranks, and each ``arg_mappings`` target gets its key's value too."""
        result = [f"++{override_key(k)}={hydra_value(v)}" for k, v in config.items()]
        if MICRO_BATCH_KEY in config or ACCUMULATION_KEY in config:
            result.append(f"++ds.train_batch_size={self.train_batch_size(config)}")
        for key, target in (arg_mappings or {}).items():
            if key in config:
                result.append(f"++{target.lstrip('-+')}={hydra_value(config[key])}")
        return result

    def describe(self) -> str:
        dims = ", ".join(f"{k} in {v}" for k, v in self.dims.items())
        text = f"{self.size} configurations: {dims}"
        if self.fixed:
            text += "; fixed " + ", ".join(f"{k}={v}" for k, v in self.fixed.items())
        return text


def _model_parallel_problem(mp: int, base_ds: Mapping[str, Any], world_size: int, script: bool) -> Problem | None:
    """``autotuning.mp_size`` must divide the ranks and, for a recipe, be the model parallelism it trains with
    (dsrun's is AutoTP: ``tensor_parallel.autotp_size``); a script may split its model itself (its mpu)."""
    if world_size % mp:
        return Problem("autotuning.mp_size", f"got {mp}; it must divide the {world_size} ranks of a trial",
                       f"use a divisor of {world_size}")
    autotp = int(ds_section(base_ds, "tensor_parallel").autotp_size or 1)
    if autotp > 1 and autotp != mp:
        return Problem("autotuning.mp_size", f"got {mp}, but the config splits the model over tensor_parallel."
                       f"autotp_size={autotp} ranks", f"set autotuning.mp_size to {autotp}")
    if not script and mp > 1 and autotp == 1:
        return Problem("autotuning.mp_size", f"got {mp}, but the recipe trains without model parallelism",
                       f"set ds.tensor_parallel.autotp_size={mp} (dsrun's model parallelism), or leave mp_size at 1")
    return None


def build_space(settings: TuneSettings, base_ds: Mapping[str, Any], world_size: int,
                script: bool = False) -> SearchSpace:
    """The search space of ``settings`` over the recipe's resolved DeepSpeed config ``base_ds`` (``script``: a
    script's config, whose model parallelism the script may make itself)."""
    mp = int(settings.mp_size)
    problem = _model_parallel_problem(mp, base_ds, world_size, script)
    if problem is not None:
        raise UserError(problem)
    base = {STAGE_KEY: int(ds_section(base_ds, "zero_optimization").stage),
            MICRO_BATCH_KEY: ds_section(base_ds, MICRO_BATCH_KEY) or 1,  # the values given (None: not given)
            ACCUMULATION_KEY: ds_section(base_ds, ACCUMULATION_KEY) or 1}
    space = {canonical_key(k): v for k, v in settings.space.items()}
    bad = [k for k in space if k.split(".")[0] in ("tune", "hydra", "ds_config")]
    if bad:
        raise UserError(Problem(f"tune.space.{bad[0]}", "cannot be tuned",
                                "tune DeepSpeed keys or model./data./train./launcher. keys"))
    if MICRO_BATCH_KEY not in space and space:
        space[MICRO_BATCH_KEY] = micro_batch_candidates(
            settings, int(space.get(ACCUMULATION_KEY, [base[ACCUMULATION_KEY]])[0]), world_size // mp)
    ignored: tuple[str, ...] = ()
    if settings.fast:
        ignored = tuple(k for k in space if k not in FAST_KEYS)
        space = {k: v for k, v in space.items() if k in FAST_KEYS}
    dims = {k: list(dict.fromkeys(v)) for k, v in space.items() if len(set(map(repr, v))) > 1}
    fixed = {k: v[0] for k, v in space.items() if k not in dims}
    if not dims:
        raise UserError(Problem("tune.space", "empty search space: no key has two or more values"
                                + (" (fast mode tunes only zero_optimization.stage and "
                                   "train_micro_batch_size_per_gpu)" if settings.fast else ""),
                                "pick a space with autotuning=fast or autotuning=full, or set "
                                "tune.space.KEY=[v1,v2]"))
    return SearchSpace(dims=dims, fixed=fixed, base=base, world_size=world_size, ignored=ignored, mp_size=mp)
