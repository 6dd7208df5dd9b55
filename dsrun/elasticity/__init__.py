"""``dsrun.elasticity``, DeepSpeed's ``deepspeed.elasticity``: pick a global batch size that many GPU counts can
train with, so an elastic job keeps its batch (and its convergence) when nodes leave or join.

::

    from dsrun.elasticity import compute_elastic_config
    batch, valid_gpus = compute_elastic_config(ds_config, target_deepspeed_version="0.14.1")
    batch, valid_gpus, micro = compute_elastic_config(ds_config, "0.14.1", world_size=8)

The search itself lives in :mod:`dsrun.config.elastic` (the config layer resolves batch sizes with it);
:mod:`.elasticity` is the API over it and :mod:`.config` the section as DeepSpeed's API reads it.
Elastic *training* (ranks restarting at a new world size) is the launcher's ``--elastic_training``
(docs/elasticity.md).
"""
from __future__ import annotations

from dsrun.elasticity.config import (ELASTICITY, ENABLED, ENABLED_DEFAULT, ElasticityConfig, ElasticityConfigError,
                                     ElasticityError, ElasticityIncompatibleWorldSize)
from dsrun.elasticity.elasticity import (compute_elastic_config, elasticity_enabled, ensure_immutable_elastic_config,
                                         get_compatible_gpus, is_torch_elastic_compatible)

__all__ = ["ELASTICITY", "ENABLED", "ENABLED_DEFAULT", "ElasticityConfig", "ElasticityConfigError", "ElasticityError",
           "ElasticityIncompatibleWorldSize", "compute_elastic_config", "elasticity_enabled",
           "ensure_immutable_elastic_config", "get_compatible_gpus", "is_torch_elastic_compatible"]
