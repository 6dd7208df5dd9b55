"""The process groups of one run, built once from the world and the parallel sizes, handed to every strategy.

:class:`ProcessGroups` holds a :class:`~dsrun.comm.topology.ProcessTopology` over the axes ``pipe``, ``data``
and ``model`` and, for this rank, one torch process group per axis. A group that spans the whole world is
the default group (``None``), so a plain data-parallel run creates no extra communicator. ZeRO partitions
over :attr:`ProcessGroups.data`; a pipeline engine sends along ``pipe``; tensor parallelism reduces along
``model``.

Expert parallelism (Mixture-of-Experts) splits each data-parallel group further, as
``deepspeed.utils.groups`` does: with ``expert_parallel_size`` E, the data-parallel ranks ``[d0 .. dD)`` form
expert-parallel groups of E consecutive ranks (the experts of one MoE layer are spread over them, tokens
move by all-to-all) and expert-data-parallel groups of the ranks at the same position in each of those
(an expert's replicas, whose gradients are averaged). World 4, data 4, E 2: expert ``[[0, 1], [2, 3]]``,
expert-data ``[[0, 2], [1, 3]]``. They are created on first request (:meth:`ProcessGroups.expert`),
collectively, so every rank must ask for the same sizes in the same order.

Sequence parallelism (DeepSpeed-Ulysses, ``sequence_parallel_size`` S) splits each data-parallel group the
same way: S consecutive data-parallel ranks share the same samples, each holding 1/S of the sequence
(:attr:`ProcessGroups.sequence`). ZeRO still partitions and reduces over the whole data axis (data x sequence,
DeepSpeed's "sequence data parallel group"): parameters are replicated within a sequence group, and the
mean of the ranks' gradients is the full gradient when each rank's loss is its share of the full-sequence mean.
World 4, S 2: sequence ``[[0, 1], [2, 3]]``, samples split over ``world / S = 2`` replicas.

Groups across pipeline stages (a ``PipelineModule``'s weights tied between stages): the ranks of some stages at
each data/model coordinate, one group per coordinate (:meth:`ProcessGroups.stage_group`), created on first
request under a name (the tie's key), collectively, and destroyed with the rest.

The run's groups are one object: the engine makes its own the current one at initialize
(:func:`set_current_groups`), and DeepSpeed's module-level getters (``deepspeed.utils.groups``:
:mod:`dsrun.moe.groups`, :mod:`dsrun.sequence.groups`) answer from :func:`current_groups`; there is no other
registry of groups or group names.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from . import comm
from .comm import ProcessGroup
from .topology import PipeModelDataParallelTopology, ProcessTopology

if TYPE_CHECKING:
    import torch

AXES = ("pipe", "data", "model")
_SINGLE = object()  # a group of this rank alone, not created until used


@dataclass(frozen=True)
class StageGroup:
    """This rank's group of some pipeline stages (the ranks holding them at its data and model coordinates)."""

    group: ProcessGroup
    ranks: list[int]  # global ranks, in the order of the stages asked for


class ProcessGroups:
    """This rank's view of the run's topology and its process groups (built collectively: every rank
    constructs it with the same sizes)."""

    def __init__(self, pipe: int = 1, model: int = 1, world_size: int | None = None, rank: int | None = None,
                 topology: ProcessTopology | None = None, sequence: int = 1):
        self.world_size = comm.get_world_size() if world_size is None else int(world_size)
        self.rank = comm.get_rank() if rank is None else int(rank)
        if topology is not None:  # a client's layout (a PipelineModule's topology); axes it lacks have size 1
            if topology.world_size() != self.world_size:
                raise ValueError(f"the topology spans {topology.world_size()} ranks; the world has {self.world_size}")
            self.topology = topology
        else:
            if self.world_size % (pipe * model):
                raise ValueError(f"world size {self.world_size} is not divisible by pipe {pipe} x model {model}")
            self.topology = PipeModelDataParallelTopology(num_pp=pipe, num_mp=model,
                                                          num_dp=self.world_size // (pipe * model))
        self._axis_groups: dict[str, ProcessGroup] = {axis: _SINGLE for axis in AXES}
        for axis in self.topology.get_axis_names():
            self._axis_groups[axis] = self._own_group(self.topology.get_axis_comm_lists(axis))
        self._expert: dict[int, tuple[ProcessGroup, ProcessGroup, list[int], list[int]]] = {}
        self._splits: dict[tuple[str, int, int], tuple[ProcessGroup, ProcessGroup, list[int], list[int]]] = {}
        self._adopted: set[tuple[str, int, int]] = set()  # keys of _splits taken from other groups (not destroyed)
        self._stage_groups: dict[tuple[str, tuple[int, ...]], StageGroup | None] = {}
        self.expert_data_first = False
        self.sequence_parallel_size = int(sequence)
        self._sequence: ProcessGroup = self._own_group(self.sequence_lists()) if sequence > 1 else _SINGLE

    def _own_group(self, lists: list[list[int]]) -> ProcessGroup:
        """Create every group of ``lists`` (a collective: all ranks create all of them, in order) and return
        this rank's; the whole world is the default group. Groups of one rank are made by that rank alone,
        when first used (:meth:`_resolve`)."""
        if len(lists) == 1 and len(lists[0]) == self.world_size:
            return None
        if all(len(ranks) == 1 for ranks in lists):
            return _SINGLE
        mine = None
        for ranks in lists:
            group = comm.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def _resolve(self, key: str | int, group: ProcessGroup, store: dict) -> ProcessGroup:
        if group is _SINGLE:
            group = store[key] = comm.new_group([self.rank], local=True)
        return group

    # --- the three axes -------------------------------------------------------------------------------
    def group(self, axis: str) -> ProcessGroup:
        """This rank's torch process group along ``axis`` (None: the whole world)."""
        return self._resolve(axis, self._axis_groups[axis], self._axis_groups)

    @property
    def data(self) -> ProcessGroup:
        """The data-parallel group ZeRO partitions over (None: the whole world)."""
        return self.group("data")

    @property
    def pipe(self) -> ProcessGroup:
        return self.group("pipe")

    @property
    def model(self) -> ProcessGroup:
        return self.group("model")

    def members(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along ``axis``."""
        if axis in AXES and axis not in self.topology.get_axis_names():
            return [self.rank]
        for ranks in self.topology.get_axis_comm_lists(axis):
            if self.rank in ranks:
                return ranks
        raise ValueError(f"no axis {axis!r}")

    def size(self, axis: str) -> int:
        return self.topology.get_dim(axis) or 1

    def coord(self, axis: str) -> int:
        return getattr(self.topology.get_coord(self.rank), axis, 0)

    # --- sequence parallelism ----------------------------------------------------------------------------
    def sequence_lists(self) -> list[list[int]]:
        """The sequence-parallel rank lists: ``sequence_parallel_size`` consecutive ranks of each data group."""
        size, dp = self.sequence_parallel_size, self.size("data")
        if size < 1 or dp % size:
            raise ValueError(f"sequence_parallel_size {size} must divide the data-parallel size {dp}")
        return [ranks[i:i + size] for ranks in self.topology.get_axis_comm_lists("data") for i in range(0, dp, size)]

    @property
    def sequence(self) -> ProcessGroup:
        """This rank's sequence-parallel group (the ranks holding shards of the same samples)."""
        if self._sequence is _SINGLE:
            self._sequence = comm.new_group([self.rank], local=True)
        return self._sequence

    def sequence_members(self) -> list[int]:
        """The global ranks of this rank's sequence-parallel group, in sequence-shard order."""
        return next(ranks for ranks in self.sequence_lists() if self.rank in ranks)

    # --- experts --------------------------------------------------------------------------------------
    def expert_lists(self, expert_parallel_size: int) -> tuple[list[list[int]], list[list[int]]]:
        """(expert-parallel rank lists, expert-data-parallel rank lists) over every data-parallel group."""
        size = int(expert_parallel_size)
        dp = self.size("data")
        if size < 1 or dp % size:
            raise ValueError(f"expert parallel size {size} must divide the data-parallel size {dp}")
        experts, replicas = [], []
        data_first = getattr(self, "expert_data_first", False)
        for ranks in self.topology.get_axis_comm_lists("data"):
            if data_first:  # DeepSpeed's use_data_before_expert_parallel_: replicas consecutive, experts strided
                step = dp // size
                replicas += [ranks[i:i + step] for i in range(0, dp, step)]
                experts += [ranks[j::step] for j in range(step)]
            else:
                blocks, strided = split_consecutive(ranks, size)
                experts += blocks
                replicas += strided
        return experts, replicas

    def set_expert_layout(self, data_first: bool) -> None:
        """Lay expert groups out data-parallel-first (``use_data_before_expert_parallelism``: an expert's
        replicas are consecutive ranks, the experts of a layer strided) instead of DeepSpeed's default
        (experts consecutive). Only before the first expert group is created."""
        if bool(data_first) == getattr(self, "expert_data_first", False):
            return
        if self._expert:
            raise ValueError("the expert-group layout cannot change after expert groups were created")
        self.expert_data_first = bool(data_first)

    def _expert_entry(self, expert_parallel_size: int) -> tuple[ProcessGroup, ProcessGroup, list[int], list[int]]:
        size = int(expert_parallel_size)
        if size not in self._expert:
            experts, replicas = self.expert_lists(size)
            mine_e = next(r for r in experts if self.rank in r)
            mine_d = next(r for r in replicas if self.rank in r)
            self._expert[size] = (self._own_group(experts), self._own_group(replicas), mine_e, mine_d)
        return self._expert[size]

    def expert_sizes(self) -> list[int]:
        """The expert-parallel sizes whose groups exist, in creation order."""
        return list(self._expert)

    def expert(self, expert_parallel_size: int) -> ProcessGroup:
        """This rank's expert-parallel group for ``expert_parallel_size`` (created on first request)."""
        return self._expert_group(expert_parallel_size, 0)

    def expert_data(self, expert_parallel_size: int) -> ProcessGroup:
        """This rank's expert-data-parallel group (an expert's replicas) for ``expert_parallel_size``."""
        return self._expert_group(expert_parallel_size, 1)

    def _expert_group(self, size: int, which: int) -> ProcessGroup:
        entry = self._expert_entry(size)
        if entry[which] is _SINGLE:
            resolved = list(entry)
            resolved[which] = comm.new_group([self.rank], local=True)
            self._expert[int(size)] = entry = tuple(resolved)
        return entry[which]

    def expert_members(self, expert_parallel_size: int) -> tuple[list[int], list[int]]:
        """The global ranks of this rank's (expert, expert-data) groups."""
        entry = self._expert_entry(expert_parallel_size)
        return entry[2], entry[3]

    # --- sub-groups of the data-parallel group: MiCS shards and replicas, hpZ secondary partitions -------
    def shard_lists(self, shard_size: int, ranks_per_node: int = 0) -> tuple[list[list[int]], list[list[int]]]:
        """Every data-parallel group cut into shard groups of ``shard_size`` consecutive ranks, and the
        replica groups of the ranks at the same place in each shard (world 4, shard 2: ``[[0, 1], [2, 3]]``
        and ``[[0, 2], [1, 3]]``). With ``ranks_per_node``, each shard group is cut again: (the node-local
        pieces of the shards, the ranks at the same place in each piece), what a hierarchical gather uses."""
        size = int(shard_size)
        dp = self.size("data")
        if size < 1 or dp % size:
            raise ValueError(f"shard size {size} must divide the data-parallel size {dp}")
        shards, replicas = [], []
        for ranks in self.topology.get_axis_comm_lists("data"):
            blocks, strided = split_consecutive(ranks, size)
            shards += blocks
            replicas += strided
        if not ranks_per_node:
            return shards, replicas
        per_node = min(int(ranks_per_node), size)
        if size % per_node:
            raise ValueError(f"shard size {size} must be a multiple of the {per_node} ranks per node")
        local, across = [], []
        for ranks in shards:
            blocks, strided = split_consecutive(ranks, per_node)
            local += blocks
            across += strided
        return local, across

    def _split(self, shard_size: int, ranks_per_node: int) -> tuple[ProcessGroup, ProcessGroup, list[int], list[int]]:
        key = ("shard", int(shard_size), int(ranks_per_node))
        if key not in self._splits:
            first, second = self.shard_lists(shard_size, ranks_per_node)
            entry = [self._own_group(first), self._own_group(second),
                     next(r for r in first if self.rank in r), next(r for r in second if self.rank in r)]
            for i in (0, 1):
                if entry[i] is _SINGLE:
                    entry[i] = comm.new_group([self.rank], local=True)
            self._splits[key] = tuple(entry)  # type: ignore[assignment]
        return self._splits[key]

    def shard(self, shard_size: int) -> ProcessGroup:
        """This rank's shard group: ``shard_size`` consecutive data-parallel ranks (created on first request,
        collectively: every rank must ask for the same sizes in the same order)."""
        return self._split(shard_size, 0)[0]

    def shard_replicas(self, shard_size: int) -> ProcessGroup:
        """This rank's replica group: the ranks holding the same shard in the other shard groups."""
        return self._split(shard_size, 0)[1]

    def shard_members(self, shard_size: int) -> tuple[list[int], list[int]]:
        """The global ranks of this rank's (shard, replica) groups."""
        entry = self._split(shard_size, 0)
        return entry[2], entry[3]

    def shard_node_groups(self, shard_size: int, ranks_per_node: int) -> tuple[ProcessGroup, ProcessGroup]:
        """(this rank's node-local piece of its shard group, the group of ranks at its place in the other
        nodes' pieces) for a hierarchical all-gather within the shard group, or a hierarchical reduce-scatter
        (qgZ; a shard group of the whole data group is the data group cut into nodes)."""
        entry = self._split(shard_size, ranks_per_node)
        return entry[0], entry[1]

    def adopt_shard_groups(self, other: "ProcessGroups") -> None:
        """Take the shard groups ``other`` has created (``zero.MiCS_Init``'s, made before the engine's groups)
        when both cut the same data-parallel groups, so this object hands out the very groups parameters were
        partitioned over instead of creating others of the same ranks. Nothing is created; they stay
        ``other``'s to destroy."""
        if other is self or other.world_size != self.world_size or \
                other.topology.get_axis_comm_lists("data") != self.topology.get_axis_comm_lists("data"):
            return
        for key, entry in other._splits.items():
            if key not in self._splits:
                self._splits[key] = entry
                self._adopted.add(key)
    # --- groups across pipeline stages (weights tied between stages) ---------------------------------------
    def stage_lists(self, stages: Sequence[int]) -> list[list[int]]:
        """For each coordinate of the other axes (data, model: the topology's order, the last fastest), the
        global ranks holding pipeline ``stages`` there."""
        topo = self.topology
        others = [axis for axis in topo.get_axis_names() if axis != "pipe"]
        return [[topo.get_rank(pipe=int(stage), **dict(zip(others, rest))) for stage in stages]
                for rest in itertools.product(*(range(topo.get_dim(axis)) for axis in others))]

    def stage_group(self, stages: Sequence[int], name: str = "") -> StageGroup | None:
        """This rank's group of pipeline ``stages`` (None when it holds none of them). The first request for a
        ``(name, stages)`` creates one group per coordinate of :meth:`stage_lists`, collectively (every rank
        asks for the same names and stages in the same order, each time a new group, even where one of another
        name has the same ranks); later ones return it."""
        key = (str(name), tuple(int(s) for s in stages))
        if key not in self._stage_groups:
            mine = None
            for ranks in self.stage_lists(key[1]):
                group = comm.new_group(ranks)
                if self.rank in ranks:
                    mine = StageGroup(group, ranks)
            self._stage_groups[key] = mine
        return self._stage_groups[key]

    def release_stage_groups(self, keep: Sequence[tuple[str, Sequence[int]]] = ()) -> None:
        """Destroy the stage groups this rank holds but those named in ``keep`` (``(name, stages)`` pairs), and
        forget them (a re-cut pipeline asks again for the ties it still has)."""
        kept = {(str(name), tuple(int(s) for s in stages)) for name, stages in keep}
        for key in [k for k in self._stage_groups if k not in kept]:
            entry = self._stage_groups.pop(key)
            if entry is not None and entry.group is not None:
                comm.destroy_process_group(entry.group)

    # --- which group a parameter lives on ----------------------------------------------------------------
    def group_of_param(self, param: torch.Tensor) -> ProcessGroup:
        """The group whose ranks hold copies of ``param``: its gradient is reduced, ZeRO partitions it, its
        initial value is broadcast over it. The data-parallel group, or for an expert parameter (DeepSpeed's
        marks: ``allreduce = False``, ``group_name = "ep_size_E"``) its expert-data-parallel group."""
        size = expert_parallel_size_of(param)
        return self.data if size is None else self.expert_data(size)

    def members_of_param(self, param: torch.Tensor) -> list[int]:
        """The global ranks of :meth:`group_of_param`'s group (the first is the broadcast source)."""
        size = expert_parallel_size_of(param)
        return self.members("data") if size is None else self.expert_members(size)[1]

    def destroy(self) -> None:
        """Destroy the groups this object created (not the world's default group)."""
        created = [g for g in self._axis_groups.values() if g is not None and g is not _SINGLE]
        created += [g for g in (getattr(self, "_sequence", None),) if g is not None and g is not _SINGLE]
        splits = [entry for key, entry in self._splits.items() if key not in self._adopted]
        for entry in list(self._expert.values()) + splits:
            created += [g for g in entry[:2] if g is not None and g is not _SINGLE]
        created += [e.group for e in getattr(self, "_stage_groups", {}).values() if e is not None and e.group is not None]
        for group in {id(g): g for g in created}.values():
            comm.destroy_process_group(group)
        self._axis_groups = {axis: None for axis in self._axis_groups}
        self._expert = {}
        self._sequence = _SINGLE
        self._splits = {}
        self._adopted = set()
        self._stage_groups = {}


_current: ProcessGroups | None = None  # the run's groups: the engine's, or the world's made for an expert group


def current_groups() -> ProcessGroups | None:
    """The run's groups (:func:`set_current_groups`), or None before any were set."""
    return _current


def set_current_groups(groups: ProcessGroups | None, expert_data_first: bool = False) -> None:
    """Make ``groups`` the run's groups (the engine's, at initialize; None forgets them). Shard groups that exist
    on the groups it replaces (``zero.MiCS_Init``'s) are adopted when they cut the same data-parallel groups.
    Expert groups that exist on the groups it replaces are created on ``groups`` too, laid out data-first when
    ``expert_data_first`` (``use_data_before_expert_parallelism``), in the same order on every rank so the
    collective creation stays aligned."""
    global _current
    previous, _current = _current, groups
    if groups is None or previous is None or previous is groups:
        return
    groups.adopt_shard_groups(previous)  # zero.MiCS_Init's shard groups, if it made the previous ones
    sizes = previous.expert_sizes()
    if sizes:
        groups.set_expert_layout(expert_data_first)
    for size in sizes:
        groups.expert(size)


def split_consecutive(ranks: list[int], size: int) -> tuple[list[list[int]], list[list[int]]]:
    """``ranks`` cut into blocks of ``size`` consecutive ranks, and the lists of the ranks at the same place in
    each block: ``[0, 1, 2, 3]``, 2 gives ``([[0, 1], [2, 3]], [[0, 2], [1, 3]])``."""
    return ([list(ranks[i:i + size]) for i in range(0, len(ranks), size)],
            [list(ranks[j::size]) for j in range(size)])


def expert_parallel_size_of(param: torch.Tensor) -> int | None:
    """E for an expert parameter (``allreduce`` False, ``group_name`` "ep_size_E"), else None."""
    if getattr(param, "allreduce", True):
        return None
    name = str(getattr(param, "group_name", "ep_size_1"))
    if not name.startswith("ep_size_") or not name[len("ep_size_"):].isdigit():
        raise ValueError(f"expert parameter with group_name {name!r}: expected 'ep_size_<E>'")
    return int(name[len("ep_size_"):])


def from_data_group(group: ProcessGroup) -> "ProcessGroups":
    """The groups of a run whose data-parallel group comes from a client ``mpu``: model parallelism fills the
    rest of the world, no pipeline."""
    dp = comm.get_world_size(group)
    world = comm.get_world_size()
    groups = ProcessGroups.__new__(ProcessGroups)
    groups.world_size, groups.rank = world, comm.get_rank()
    groups.topology = PipeModelDataParallelTopology(num_pp=1, num_mp=world // dp, num_dp=dp)
    groups._axis_groups = {"pipe": None, "data": group, "model": None}
    groups._expert = {}
    groups.sequence_parallel_size, groups._sequence = 1, _SINGLE
    groups._splits = {}
    groups._adopted = set()
    groups._stage_groups = {}
    return groups
