"""``launcher=ray``: the keys of a job whose ranks Ray Train starts (docs/cluster.md, "Ray").

Ray, not dsrun, starts the ranks: ``dsrun train launcher=ray`` hands the run to a ``ray.train.torch.TorchTrainer``
whose workers each run the worker's loop (:mod:`dsrun.ray`). The ``launcher:`` mapping then has its own keys,
and a key of dsrun's own launcher (a hostfile, ssh, a master port) does nothing there, so it is refused::

    launcher:
      runner: ray
      num_procs: 2                # Ray Train workers, one rank each (ScalingConfig.num_workers)
      resources_per_worker: null  # e.g. {CPU: 2}; null: Ray's default (1 CPU, or 1 GPU with use_gpu)
      use_gpu: false              # one GPU per worker (ScalingConfig.use_gpu)
      max_failures: 0             # group restarts after a worker fails (FailureConfig.max_failures; -1: no limit)
      max_preemption_failures: -1 # group restarts after a node drain (FailureConfig.max_preemption_failures;
                                  # -1: no limit); a drain is not counted in max_failures
      address: null               # a running cluster ("auto", "ray://host:10001", host:port); null: the one
                                  # RAY_ADDRESS names, else a local Ray started for the job on this machine's CPUs
      storage_path: null          # where Ray keeps the checkpoints it registers (RunConfig.storage_path);
                                  # null: the run directory's ray/ folder
      num_cpus: null              # CPUs of a local Ray started for the job (null: num_procs x the CPUs per worker)

Ray itself is an optional dependency (``pip install 'dsrun[ray]'``): asking for it without the package is one
problem, found before anything starts.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from dsrun.utils.errors import Problem, UserError, show
from dsrun.utils.suggest import did_you_mean

RAY_RUNNER = "ray"
INSTALL_HINT = "pip install 'dsrun[ray]'"

# key -> (accepted Python types, what the message calls them)
RAY_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "runner": ((str,), "str"),
    "num_procs": ((int,), "int"),
    "resources_per_worker": ((dict,), "a mapping of resource name to amount"),
    "use_gpu": ((bool,), "bool"),
    "max_failures": ((int,), "int"),
    "max_preemption_failures": ((int,), "int"),
    "address": ((str,), "str"),
    "storage_path": ((str,), "str"),
    "num_cpus": ((int,), "int"),
}


@dataclass(frozen=True)
class RayOptions:
    """What a Ray Train job of dsrun's worker is asked for (the module docstring's keys)."""

    num_procs: int = 2
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    use_gpu: bool = False
    max_failures: int = 0
    max_preemption_failures: int = -1
    address: str | None = None
    storage_path: str | None = None
    num_cpus: int | None = None

    def local_cpus(self) -> int:
        """CPUs of a local Ray started for the job: ``num_cpus``, else enough for every worker and no more."""
        if self.num_cpus is not None:
            return self.num_cpus
        return max(1, math.ceil(self.num_procs * self.resources_per_worker.get("CPU", 1)))


def ray_importable() -> bool:
    """Whether ``import ray`` works here (the optional dependency is installed)."""
    try:  # the package itself: its train extra is imported where the job runs (dsrun.ray)
        importlib.import_module("ray")
    except ImportError:
        return False
    return True


def ray_options_from_mapping(mapping: Mapping[str, Any], path: str = "launcher") -> RayOptions:
    """:class:`RayOptions` from a RunSpec ``launcher:`` mapping with ``runner: ray``; every problem (a key the ray
    launcher does not read, a value of the wrong type or range, Ray not installed) names its key path."""
    problems: list[Problem] = []
    values: dict[str, Any] = {}
    for key, value in mapping.items():
        if key not in RAY_KEYS:
            problems.append(Problem(f"{path}.{key}", "is not read by the ray launcher (Ray starts the ranks)",
                                    did_you_mean(key, RAY_KEYS) or f"its keys: {', '.join(RAY_KEYS)}"))
            continue
        types, expected = RAY_KEYS[key]
        if value is None or key == "runner":
            continue
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            problems.append(Problem(f"{path}.{key}", f"must be {expected}, got {show(value)}"))
            continue
        values[key] = value
    problems += _range_problems(values, path)
    if not problems and not ray_importable():
        problems.append(Problem(f"{path}.runner", "is 'ray', but Ray is not installed", INSTALL_HINT))
    if problems:
        raise UserError(problems)
    resources = {str(name): float(amount) for name, amount in values.pop("resources_per_worker", {}).items()}
    return RayOptions(resources_per_worker=resources, **values)


def _range_problems(values: Mapping[str, Any], path: str) -> list[Problem]:
    found: list[Problem] = []
    if values.get("num_procs", 1) < 1:
        found.append(Problem(f"{path}.num_procs", f"must be at least 1, got {values['num_procs']}"))
    if values.get("num_cpus", 1) < 1:
        found.append(Problem(f"{path}.num_cpus", f"must be at least 1, got {values['num_cpus']}"))
    for key in ("max_failures", "max_preemption_failures"):
        if values.get(key, 0) < -1:
            found.append(Problem(f"{path}.{key}", f"must be -1 (no limit) or more, got {values[key]}"))
    for name, amount in (values.get("resources_per_worker") or {}).items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            found.append(Problem(f"{path}.resources_per_worker.{name}", f"must be a number 0 or more, got {show(amount)}"))
    return found
