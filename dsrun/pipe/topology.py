"""``PipelineParallelGrid``: this rank's place on a pipeline topology and its process groups (the ``mpu`` a
:class:`~dsrun.pipe.module.PipelineModule` hands the engine, DeepSpeed's name and methods).

The topology (:mod:`dsrun.comm.topology`) lays ranks out on the axes ``pipe``, ``data`` and optionally
``model``; the grid turns it into a :class:`dsrun.comm.ProcessGroups` (built collectively, every rank with the
same topology) and answers the mpu questions the engine asks: the data-parallel group ZeRO partitions over,
the pipe group the stages talk in, and which global rank holds stage ``s`` of this rank's pipeline.
"""
from __future__ import annotations

import math

from dsrun import comm
from dsrun.comm import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessGroups, ProcessTopology
from dsrun.comm.comm import ProcessGroup

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid", "ProcessTopology"]


def _prime_factors(n: int) -> list[int]:
    """The prime factorisation of a positive integer, smallest first (``12`` -> ``[2, 2, 3]``, ``1`` -> ``[]``);
    DeepSpeed's helper for laying out grids."""
    if n <= 0:
        raise ValueError("Values must be strictly positive.")
    primes, candidate = [], 2
    while n != 1:
        while n % candidate:
            candidate += 1
        primes.append(candidate)
        n //= candidate
    return primes


class PipelineParallelGrid:
    """The process groups of a pipeline-parallel run, seen from this rank."""

    def __init__(self, topology: ProcessTopology | None = None, process_group: ProcessGroup = None):
        if process_group is not None:
            raise ValueError("PipelineParallelGrid(process_group=...): only the default (world) group is supported")
        world = comm.get_world_size()
        if topology is None:  # one stage per rank, as DeepSpeed's default grid
            topology = PipeDataParallelTopology(num_pp=world, num_dp=1)
        missing = {"pipe", "data"} - set(topology.get_axis_names())
        if missing:
            raise ValueError(f"a pipeline topology needs the axes 'pipe' and 'data'; missing {sorted(missing)}")
        self._topo = topology
        self.global_rank = comm.get_rank()
        self.world_size = world
        self.groups = ProcessGroups(topology=topology)
        self.pipe_parallel_size = self.groups.size("pipe")
        self.data_parallel_size = self.groups.size("data")
        self.model_parallel_size = self.groups.size("model")
        self.stage_id = self.groups.coord("pipe")
        self.data_parallel_id = self.groups.coord("data")
        self.model_parallel_id = self.groups.coord("model")
        # DeepSpeed's grid keeps these as plain values: flags, and the global ranks of this rank's groups
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.pp_group = self.groups.members("pipe")
        self.dp_group = self.groups.members("data")

    def topology(self) -> ProcessTopology:
        return self._topo

    def _is_grid_valid(self) -> bool:
        """Whether the topology's axes multiply out to the world size (DeepSpeed's check)."""
        return math.prod(self._topo.get_dim(axis) for axis in self._topo.get_axis_names()) == comm.get_world_size()

    # --- stages --------------------------------------------------------------------------------------------
    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of stage ``stage_id`` at this rank's other coordinates (``kwargs`` override them)."""
        coord = self._topo.get_coord(self.global_rank)._asdict()
        coord.update(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord)

    # --- DeepSpeed's mpu interface ---------------------------------------------------------------------------
    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> ProcessGroup:
        return self.groups.pipe

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> ProcessGroup:
        return self.groups.data

    def get_model_parallel_rank(self) -> int:
        return self.model_parallel_id

    def get_model_parallel_world_size(self) -> int:
        return self.model_parallel_size

    def get_model_parallel_group(self) -> ProcessGroup:
        return self.groups.model

    def get_slice_parallel_rank(self) -> int:
        """This rank's index among the ranks of its model replica (every stage, every model-parallel rank),
        in topology order: the ``XX`` of a pipeline checkpoint's ``mp_rank_XX`` files."""
        return self.stage_id * self.model_parallel_size + self.model_parallel_id

    def get_slice_parallel_world_size(self) -> int:
        return self.pipe_parallel_size * self.model_parallel_size
