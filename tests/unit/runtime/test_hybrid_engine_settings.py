"""The ``hybrid_engine`` section's refusals, in a world of one (the generation itself: tests/integration/
test_hybrid_engine.py): each is one line naming the key and why."""
from __future__ import annotations

import pytest
import torch

import dsrun
from dsrun.utils.errors import ConfigError

pytestmark = pytest.mark.usefixtures("world_of_one")


def _engine(stage: int, **hybrid: object):
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage}, "hybrid_engine": hybrid}
    return dsrun.initialize(model=torch.nn.Linear(4, 4), config=config)[0]


def test_enable_cuda_graph_is_refused_with_the_reason():
    # on a CPU the reason is the accelerator (on CUDA: ZeRO-3, release_inference_cache, inference_tp_size > 1)
    with pytest.raises(ConfigError, match=r"hybrid_engine.enable_cuda_graph: CUDA graphs require the CUDA "
                                          r"accelerator \(set hybrid_engine.enable_cuda_graph: false\)"):
        _engine(0, enabled=True, enable_cuda_graph=True)


def test_the_sections_keys_need_enabled_and_the_split_needs_zero3_pinned():
    with pytest.raises(ConfigError, match=r"hybrid_engine.max_out_tokens: acts only with hybrid_engine.enabled"):
        _engine(0, max_out_tokens=64)
    with pytest.raises(ConfigError, match=r"hybrid_engine.inference_tp_size: 2 splits the layers it gathers for "
                                          r"generation, which happens only at ZeRO stage 3 with hybrid_engine."
                                          r"pin_parameters"):
        _engine(2, enabled=True, inference_tp_size=2)
    engine = _engine(1, enabled=True)
    assert type(engine).__name__ == "DeepSpeedHybridEngine" and engine.mp_group is None
    assert isinstance(engine, dsrun.DeepSpeedEngine) and not engine.Z3_enabled
    engine.destroy()
