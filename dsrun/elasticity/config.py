"""``deepspeed.elasticity.config``: the elastic section as DeepSpeed's elasticity API reads it, and its errors.

:class:`ElasticityConfig` takes the ``elasticity`` dict alone (not a whole DeepSpeed config) and checks it the
way DeepSpeed does: with ``enabled`` true, ``max_train_batch_size`` and ``micro_batch_sizes`` are required;
micro batches must be a list of positive integers; ``min_gpus``/``max_gpus`` at least 1 with
``min_gpus <= max_gpus``; ``model_parallel_size`` and ``num_gpus_per_node`` at least 1; ``min_time`` at least
0. Every failure is an :class:`ElasticityConfigError` naming the key. (``dsrun.config`` validates the same
section as part of a whole config, with one line per problem; this class is for code written against
DeepSpeed's API.)
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from dsrun.config.elastic import (LATEST_ELASTICITY_VERSION, ElasticityConfigError, ElasticityError,
                                  ElasticityIncompatibleWorldSize)

__all__ = ["ElasticityConfig", "ElasticityConfigError", "ElasticityError", "ElasticityIncompatibleWorldSize",
           "ELASTICITY", "ENABLED", "ENABLED_DEFAULT", "LATEST_ELASTICITY_VERSION", "MINIMUM_DEEPSPEED_VERSION"]

ELASTICITY = "elasticity"
ENABLED = "enabled"
ENABLED_DEFAULT = False
MINIMUM_DEEPSPEED_VERSION = "0.3.8"  # the first DeepSpeed release with elasticity
DEFAULTS: dict[str, Any] = {
    "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "min_gpus": 1, "max_gpus": 10000,
    "num_gpus_per_node": 1, "model_parallel_size": 1, "min_time": 0, "version": LATEST_ELASTICITY_VERSION,
    "prefer_larger_batch": True, "ignore_non_elastic_batch_info": False,
}


class ElasticityConfig:
    """The ``elasticity`` section with DeepSpeed's attribute names (``max_acceptable_batch_size``,
    ``micro_batches``, ``prefer_larger_batch_size``, ...)."""

    def __init__(self, param_dict: Mapping[str, Any]):
        if not isinstance(param_dict, Mapping):
            raise ElasticityConfigError(f"the elasticity section must be a dict, got {type(param_dict).__name__}")
        self.enabled = bool(param_dict.get(ENABLED, ENABLED_DEFAULT))
        if self.enabled:
            for key in ("max_train_batch_size", "micro_batch_sizes"):
                if key not in param_dict:
                    raise ElasticityConfigError(f"elasticity.{key} is required when elasticity is enabled")

        def get(key: str) -> Any:
            return param_dict.get(key, DEFAULTS[key])

        self.max_acceptable_batch_size = get("max_train_batch_size")
        self.micro_batches = get("micro_batch_sizes")
        if not isinstance(self.micro_batches, list):
            raise ElasticityConfigError(f"elasticity.micro_batch_sizes must be a list of micro batch sizes, got "
                                        f"{type(self.micro_batches).__name__} {self.micro_batches!r}")
        if not all(isinstance(m, int) and not isinstance(m, bool) for m in self.micro_batches):
            raise ElasticityConfigError(f"elasticity.micro_batch_sizes must hold integers only, got {self.micro_batches!r}")
        if not all(m > 0 for m in self.micro_batches):
            raise ElasticityConfigError(f"elasticity.micro_batch_sizes must hold positive integers only, got "
                                        f"{self.micro_batches!r}")
        self.min_gpus, self.max_gpus = get("min_gpus"), get("max_gpus")
        if self.min_gpus < 1 or self.max_gpus < 1:
            raise ElasticityConfigError(f"elasticity.min_gpus and max_gpus must be at least 1, got min_gpus "
                                        f"{self.min_gpus}, max_gpus {self.max_gpus}")
        if self.max_gpus < self.min_gpus:
            raise ElasticityConfigError(f"elasticity.min_gpus {self.min_gpus} is greater than max_gpus {self.max_gpus}")
        self.model_parallel_size = get("model_parallel_size")
        if self.model_parallel_size < 1:
            raise ElasticityConfigError(f"elasticity.model_parallel_size must be at least 1, got "
                                        f"{self.model_parallel_size}")
        self.num_gpus_per_node = get("num_gpus_per_node")
        if self.num_gpus_per_node < 1:
            raise ElasticityConfigError(f"elasticity.num_gpus_per_node must be at least 1, got {self.num_gpus_per_node}")
        self.min_time = get("min_time")
        if self.min_time < 0:
            raise ElasticityConfigError(f"elasticity.min_time must be 0 or more (minutes), got {self.min_time}")
        self.version = get("version")
        self.prefer_larger_batch_size = get("prefer_larger_batch")
        self.ignore_non_elastic_batch_info = get("ignore_non_elastic_batch_info")

    def repr(self) -> dict[str, Any]:
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4)
