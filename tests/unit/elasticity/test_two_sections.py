"""The ``elasticity`` section has two readers with different defaults, and each path keeps its own:
DeepSpeed's ``deepspeed.elasticity.config.ElasticityConfig`` (a dict in, DeepSpeed's attribute names and
DeepSpeed's defaults out) and the schema's :class:`dsrun.config.misc.ElasticitySection` (no batch defaults: an
enabled section must name them)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.helpers import REPO


def test_deepspeeds_elasticity_config_keeps_deepspeeds_defaults():
    from dsrun.elasticity.config import ElasticityConfig

    config = ElasticityConfig({})
    assert vars(config) == {
        "enabled": False, "max_acceptable_batch_size": 2000, "micro_batches": [2, 4, 6], "min_gpus": 1,
        "max_gpus": 10000, "model_parallel_size": 1, "num_gpus_per_node": 1, "min_time": 0, "version": 0.2,
        "prefer_larger_batch_size": True, "ignore_non_elastic_batch_info": False}


def test_the_schema_section_has_no_batch_defaults():
    from dsrun.config import DSConfig
    from dsrun.config.misc import ElasticitySection

    section = ElasticitySection()
    assert section.model_dump() == {
        "enabled": False, "max_train_batch_size": None, "micro_batch_sizes": None, "min_gpus": 1, "max_gpus": 10000,
        "min_time": 0, "prefer_larger_batch": True, "version": 0.2, "ignore_non_elastic_batch_info": False,
        "num_gpus_per_node": 1, "model_parallel_size": 1}
    assert DSConfig().elasticity == section


def test_deepspeeds_path_serves_deepspeeds_class():
    code = textwrap.dedent("""
        import dsrun.alias
        dsrun.alias.install()
        import deepspeed.elasticity.config, deepspeed.elasticity, dsrun.elasticity.config
        assert deepspeed.elasticity.config.ElasticityConfig is dsrun.elasticity.config.ElasticityConfig
        assert deepspeed.elasticity.ElasticityConfig is dsrun.elasticity.config.ElasticityConfig
        assert deepspeed.elasticity.config.ElasticityConfig({}).max_acceptable_batch_size == 2000
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True, capture_output=True, timeout=180,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
