"""The structured configs of ``hydra/sweeper=optuna`` and its samplers (``hydra/sweeper/sampler=NAME``).

The shape is that of the ``hydra-optuna-sweeper`` plugin, so configs written for it keep working; the
samplers are Optuna 3.5+'s. Importing this module (Hydra does when it scans ``hydra_plugins``) registers
the configs in Hydra's ConfigStore.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

SWEEPER_TARGET = "hydra_plugins.dsrun_optuna_sweeper.optuna_sweeper.OptunaSweeper"


@dataclass
class TPESamplerConfig:
    """https://optuna.readthedocs.io/en/stable/reference/samplers/generated/optuna.samplers.TPESampler.html"""

    _target_: str = "optuna.samplers.TPESampler"
    seed: Optional[int] = None
    consider_prior: Optional[bool] = None
    prior_weight: Optional[float] = None
    consider_magic_clip: Optional[bool] = None
    consider_endpoints: Optional[bool] = None
    n_startup_trials: int = 10
    n_ei_candidates: int = 24
    multivariate: Optional[bool] = None
    group: bool = False
    warn_independent_sampling: Optional[bool] = None
    constant_liar: bool = True


@dataclass
class RandomSamplerConfig:
    _target_: str = "optuna.samplers.RandomSampler"
    seed: Optional[int] = None


@dataclass
class CmaEsSamplerConfig:
    """Needs the ``cmaes`` package."""

    _target_: str = "optuna.samplers.CmaEsSampler"
    x0: Optional[Dict[str, Any]] = None
    sigma0: Optional[float] = None
    seed: Optional[int] = None
    n_startup_trials: int = 1
    warn_independent_sampling: bool = True
    consider_pruned_trials: bool = False
    restart_strategy: Optional[str] = None
    popsize: Optional[int] = None
    inc_popsize: int = -1
    use_separable_cma: bool = False
    with_margin: bool = False
    lr_adapt: bool = False


@dataclass
class NSGAIISamplerConfig:
    _target_: str = "optuna.samplers.NSGAIISampler"
    population_size: int = 50
    mutation_prob: Optional[float] = None
    crossover_prob: float = 0.9
    swapping_prob: float = 0.5
    seed: Optional[int] = None


@dataclass
class MOTPESamplerConfig(TPESamplerConfig):
    """Optuna 4 folded MOTPESampler into TPESampler, which handles several objectives itself."""


@dataclass
class GridSamplerConfig:
    """``search_space`` null: the grid is the sweep's own discrete params (``choice``/``range`` values), so the
    sampler is built by the sweeper once it knows them."""

    _target_: str = "hydra_plugins.dsrun_optuna_sweeper.optuna_sweeper.grid_sampler"
    search_space: Optional[Dict[str, Any]] = None
    seed: Optional[int] = None


@dataclass
class QMCSamplerConfig:
    _target_: str = "optuna.samplers.QMCSampler"
    qmc_type: str = "sobol"
    scramble: bool = False
    seed: Optional[int] = None
    warn_asynchronous_seeding: bool = True
    warn_independent_sampling: bool = True


@dataclass
class GPSamplerConfig:
    """Gaussian-process Bayesian optimisation (Optuna 3.6+; needs scipy and torch)."""

    _target_: str = "optuna.samplers.GPSampler"
    seed: Optional[int] = None
    n_startup_trials: int = 10
    deterministic_objective: bool = False


@dataclass
class OptunaSweeperConf:
    """``hydra.sweeper`` for ``hydra/sweeper=optuna``.

    direction: ``minimize`` | ``maximize``, or a list of them for several objectives.
    storage: an Optuna storage URL (``sqlite:///optuna.db``), a ``_target_`` config, or null (in memory).
    study_name: with a storage, re-running continues the same study.
    n_trials: trials in all; n_jobs: trials per batch handed to the launcher at once.
    max_failure_rate: the share of failed trials tolerated before the sweep stops launching new ones.
    params: ``key: sweep`` in Hydra's override syntax (``choice(...)``, ``a,b,c``, ``range(...)``,
      ``interval(...)``, ``tag(log, interval(...))``, ``int(interval(...))``); a plain value is fixed.
    custom_search_space: ``module.function(cfg, trial)`` that suggests further params through the trial.
    """

    _target_: str = SWEEPER_TARGET
    defaults: List[Any] = field(default_factory=lambda: [{"sampler": "tpe"}])
    sampler: Any = MISSING  # filled by the defaults list: hydra/sweeper/sampler=tpe
    direction: Any = "minimize"
    storage: Optional[Any] = None
    study_name: Optional[str] = None
    n_trials: int = 20
    n_jobs: int = 2
    max_failure_rate: float = 0.0
    search_space: Optional[Dict[str, Any]] = None  # Hydra 1.1's form: refused with a pointer to params
    params: Optional[Dict[str, Any]] = None
    custom_search_space: Optional[str] = None


SAMPLERS = {
    "tpe": TPESamplerConfig,
    "random": RandomSamplerConfig,
    "cmaes": CmaEsSamplerConfig,
    "nsgaii": NSGAIISamplerConfig,
    "motpe": MOTPESamplerConfig,
    "grid": GridSamplerConfig,
    "qmc": QMCSamplerConfig,
    "gp": GPSamplerConfig,
}

_store = ConfigStore.instance()
_store.store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider="dsrun_optuna_sweeper")
for _name, _node in SAMPLERS.items():
    _store.store(group="hydra/sweeper/sampler", name=_name, node=_node, provider="dsrun_optuna_sweeper")
