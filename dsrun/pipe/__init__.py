"""Pipeline parallelism (DeepSpeed's ``deepspeed.runtime.pipe``): the PipelineModule, its topology and grid,
the schedules as instruction streams, the simulator, point-to-point messages and the pipeline engine.
Users import the public names from :mod:`dsrun.pipe`; see docs/pipeline.md."""
from dsrun.pipe.module import PipelineModule
from dsrun.pipe.partition import partition_balanced, partition_uniform, profiling_inputs
from dsrun.pipe.spec import LayerSpec, TiedLayerSpec
from dsrun.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid, PipeModelDataParallelTopology, ProcessTopology

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineModule",
           "PipelineParallelGrid", "ProcessTopology", "TiedLayerSpec", "partition_balanced", "partition_uniform",
           "profiling_inputs"]
