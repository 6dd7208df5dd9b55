"""Process topologies: ranks laid out on a grid of named axes (DeepSpeed's ``ProcessTopology`` semantics).

The layout is row-major over ``axes``: the last axis varies fastest, so with ``axes=['pipe', 'data']`` and
``dims=[2, 2]`` rank = pipe * 2 + data. A group *along* an axis is the set of ranks that agree on every other
axis (:meth:`ProcessTopology.get_axis_comm_lists`). ``PipeDataParallelTopology`` and
``PipeModelDataParallelTopology`` fix DeepSpeed's axis orders. :mod:`dsrun.comm.groups` turns a topology into
torch process groups.
"""
from __future__ import annotations

import itertools
import math
from collections import namedtuple
from typing import Any


class ProcessTopology:
    """Maps n-dimensional coordinates on named ``axes`` of sizes ``dims`` to linear ranks (row-major)."""

    def __init__(self, axes: list[str], dims: list[int]):
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(f"axes {axes} and dims {dims} must be the same length, axis names distinct")
        if any(int(d) < 1 for d in dims):
            raise ValueError(f"every dim must be at least 1, got {dims}")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self.mapping: dict[Any, int] = {}
        for rank, coord in enumerate(itertools.product(*(range(d) for d in self.dims))):
            self.mapping[self.ProcessCoord(*coord)] = rank

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at the given coordinates (every axis named)."""
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank() needs every axis of {self.axes}, got {sorted(coord_kwargs)}")
        return self.mapping[self.ProcessCoord(**coord_kwargs)]

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_rank_repr(self, rank: int, omit_axes: list[str] | None = None, inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """``'a_01-b_01'`` for rank 3 of a 2x2 topology on axes a, b (axes in ``omit_axes`` left out;
        default: data and pipe, as checkpoint file names use it)."""
        omit = ["data", "pipe"] if omit_axes is None else omit_axes
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes
                              if axis not in omit)

    def get_dim(self, axis: str) -> int:
        """Processes along ``axis`` (0 if the topology has no such axis)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"rank {rank} is not in a topology of {self.world_size()} ranks")

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """One rank list per group along ``axis``: ranks that match on every other axis, in order."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for rest in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, rest))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Ranks whose coordinates match every ``axis=value`` given."""
        return [rank for coord, rank in self.mapping.items()
                if all(getattr(coord, axis) == value for axis, value in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate on ``axis`` is ``idx``."""
        if axis not in self.axes:
            return []
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return math.prod(self.dims)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline stages outermost, data parallelism innermost (adjacent ranks share a stage)."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline, then data, then model (tensor) parallelism innermost."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
