"""``dsrun.pipe``: DeepSpeed's ``deepspeed.pipe`` -- ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec`` and the
topologies -- plus ``profiling_inputs`` for ``partition_method='profile'``.

::

    from dsrun.pipe import PipelineModule, LayerSpec
    net = PipelineModule(layers=[LayerSpec(nn.Linear, 16, 64), nn.ReLU(), LayerSpec(nn.Linear, 64, 4)],
                         num_stages=2, loss_fn=nn.functional.mse_loss)
    engine, _, _, _ = dsrun.initialize(model=net, config=ds_config)
    loss = engine.train_batch(data_iter)

The implementation is in :mod:`dsrun.runtime.pipe`; docs/pipeline.md explains schedules, tied weights,
checkpoints and the ``pipeline`` config section.
"""
from dsrun.runtime.pipe import (LayerSpec, PipeDataParallelTopology, PipelineModule, PipeModelDataParallelTopology,
                                ProcessTopology, TiedLayerSpec, profiling_inputs)

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineModule",
           "ProcessTopology", "TiedLayerSpec", "profiling_inputs"]
