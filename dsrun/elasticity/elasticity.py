"""``deepspeed.elasticity.elasticity``: :func:`compute_elastic_config` and its helpers.

The search is DeepSpeed's (versions 0.1 and 0.2, described in :mod:`dsrun.config.elastic`); the same call
with the same config always gives the same answer, so a scheduler and every rank agree on the batch.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Sequence

from dsrun.config.elastic import (LATEST_ELASTICITY_VERSION, SCHEDULER_CONFIG_ENV, compatible_gpus_v01,
                                  compatible_gpus_v02, for_world_size, scheduler_mismatch,
                                  search)
from dsrun.elasticity.config import (ELASTICITY, ENABLED, ENABLED_DEFAULT, MINIMUM_DEEPSPEED_VERSION,
                                     ElasticityConfig, ElasticityConfigError, ElasticityError)

logger = logging.getLogger("dsrun.elasticity")


def _version_tuple(text: str) -> tuple[int, ...]:
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)", str(text))
    if not match:
        raise ElasticityError(f"target_deepspeed_version {text!r} is not a version number (expected e.g. '0.14.1')")
    return tuple(int(part) for part in match.group(1).split("."))


def _compatible_ds_version_check(target_deepspeed_version: str) -> bool:
    """True when ``target_deepspeed_version`` has elasticity (0.3.8 or later); raises otherwise."""
    target, minimum = _version_tuple(target_deepspeed_version), _version_tuple(MINIMUM_DEEPSPEED_VERSION)
    width = max(len(target), len(minimum))
    if target + (0,) * (width - len(target)) < minimum + (0,) * (width - len(minimum)):
        raise ElasticityError(f"target DeepSpeed version {target_deepspeed_version} has no elasticity; it needs "
                              f"{MINIMUM_DEEPSPEED_VERSION} or later")
    return True


def elasticity_enabled(ds_config: dict) -> bool:
    """Whether ``ds_config`` has an ``elasticity`` section with ``enabled`` true."""
    if ELASTICITY not in ds_config:
        return False
    return bool(ds_config[ELASTICITY].get(ENABLED, ENABLED_DEFAULT))


def ensure_immutable_elastic_config(runtime_elastic_config_dict: dict) -> None:
    """Raise :class:`ElasticityConfigError` when the resource scheduler computed its GPU counts from a
    different elastic section (``DEEPSPEED_ELASTICITY_CONFIG``: max batch, micro batches or version differ);
    warn when the scheduler published none."""
    if SCHEDULER_CONFIG_ENV not in os.environ:
        logger.warning("%s is not set: cannot check that the resource scheduler scales this job to GPU counts "
                       "its elastic batch allows", SCHEDULER_CONFIG_ENV)
        return
    runtime = ElasticityConfig(runtime_elastic_config_dict)
    mismatch = scheduler_mismatch(runtime.max_acceptable_batch_size, runtime.micro_batches, runtime.version)
    if mismatch:
        raise ElasticityConfigError(mismatch)


def get_compatible_gpus(micro_batches: Sequence[int], max_acceptable_batch_size: int, min_gpus: int | None = None,
                        max_gpus: int | None = None, prefer_larger: bool = True, *, version: float = 0.1,
                        current_num_gpus: int | None = None, num_gpus_per_node: int = 1,
                        model_parallel_size: int = 1) -> tuple[Any, ...]:
    """The elastic search alone, without a config: version 0.1 returns ``(batch, valid GPU counts)``;
    version 0.2 needs ``current_num_gpus`` and returns ``(batch, valid data-parallel sizes, micro batch)``."""
    if float(version) == 0.1:
        return compatible_gpus_v01(micro_batches, max_acceptable_batch_size, min_gpus, max_gpus, prefer_larger)
    if float(version) == 0.2:
        if not current_num_gpus:
            raise ElasticityConfigError("elasticity v0.2 needs current_num_gpus (the world size)")
        return compatible_gpus_v02(micro_batches, max_acceptable_batch_size, current_num_gpus, min_gpus, max_gpus,
                                   prefer_larger, num_gpus_per_node, model_parallel_size)
    raise ElasticityConfigError(f"no elastic logic for version {version}; versions 0.1 and 0.2 exist")


def _world_size_from_env() -> int:
    text = os.environ.get("WORLD_SIZE")
    if text is None or not text.isdigit():
        raise ElasticityConfigError(f"elasticity v0.2 needs the world size to compute a valid batch size: pass "
                                    f"world_size= or set WORLD_SIZE (WORLD_SIZE is {text!r})")
    return int(text)


def compute_elastic_config(ds_config: dict, target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False) -> tuple[Any, ...]:
    """The elastic global batch size and the GPU counts it allows, for the ``elasticity`` section of
    ``ds_config``.

    Returns ``(final_batch_size, valid_gpus)``; with ``world_size > 0`` (which must be one of the valid
    counts: :class:`ElasticityIncompatibleWorldSize` otherwise) or ``return_microbatch``, also the micro
    batch size: the largest acceptable one dividing ``final_batch_size // world_size`` (version 0.2 without
    a world size: its own pick for ``WORLD_SIZE``). Version 0.2 reads ``WORLD_SIZE`` from the environment
    when ``world_size`` is 0. Raises :class:`ElasticityConfigError` for a missing, disabled or invalid
    section and :class:`ElasticityError` when ``target_deepspeed_version`` predates elasticity (0.3.8).
    """
    if not isinstance(ds_config, dict):
        raise ValueError(f"expected ds_config to be a dict, got {type(ds_config).__name__}: {ds_config!r}")
    if ELASTICITY not in ds_config:
        raise ElasticityConfigError(f"'{ELASTICITY}' is missing from the config; add it to run an elastic job")
    section = ds_config[ELASTICITY]
    if not isinstance(section, dict) or not section.get(ENABLED, ENABLED_DEFAULT):
        raise ElasticityConfigError("elasticity is disabled; set \"enabled\": true to run an elastic job")
    config = ElasticityConfig(section)
    version = float(config.version)
    if config.model_parallel_size > 1 and version != 0.2:
        raise ElasticityConfigError(f"elasticity v{config.version} does not support model parallelism "
                                    f"(model_parallel_size {config.model_parallel_size}); use version 0.2")
    if version > LATEST_ELASTICITY_VERSION:
        raise ElasticityConfigError(f"elasticity version {config.version} is newer than the latest this runtime "
                                    f"knows ({LATEST_ELASTICITY_VERSION})")
    _compatible_ds_version_check(target_deepspeed_version)
    current = (world_size or _world_size_from_env()) if version == 0.2 else world_size
    batch, valid, micro = search(version, config.micro_batches, config.max_acceptable_batch_size, config.min_gpus,
                                 config.max_gpus, config.prefer_larger_batch_size, current,
                                 config.num_gpus_per_node, config.model_parallel_size)
    logger.info("elasticity: valid world sizes (GPUs / model-parallel size): %s", valid)
    if world_size > 0:
        return batch, valid, for_world_size(batch, valid, world_size, config.micro_batches)
    if return_microbatch:
        if version == 0.2:
            return batch, valid, micro
        # DeepSpeed divides by the world size 0 here; without a world size there is no per-rank share
        raise ElasticityConfigError("elasticity v0.1 picks the micro batch for a world size: pass world_size > 0")
    return batch, valid


def is_torch_elastic_compatible() -> bool:
    """Whether torch has the elastic agent elastic training needs (torch 1.11 or later: always, for dsrun)."""
    import torch

    return tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2]) >= (1, 11)


__all__ = ["compute_elastic_config", "elasticity_enabled", "ensure_immutable_elastic_config", "get_compatible_gpus",
           "is_torch_elastic_compatible"]
