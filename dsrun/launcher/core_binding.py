"""Which cores each rank of a node is bound to (DeepSpeed's ``--bind_cores_to_rank``), NUMA-aware, and when
``dsrun train`` binds by default.

The cores to share are ``--bind_core_list`` when given, else those this process may run on
(``os.sched_getaffinity``). Without a list, on a host with several NUMA nodes (``/sys/devices/system/node``)
whose number divides the ranks, each node takes an equal number of ranks and each of those ranks an equal,
contiguous share of that node's cores, so no rank straddles two nodes and its memory (first touched by its own
threads) stays on its node. Otherwise the cores are cut in equal contiguous shares in order (DeepSpeed's split).
Cores left over by an uneven split stay unused, as in DeepSpeed. Each bound rank runs ``OMP_NUM_THREADS`` =
its share (``rank_exec.py``).

``dsrun train`` binds by default (``launcher.bind_cores_to_rank: null``) when the run offloads optimizer state
or parameters (``offload_optimizer``/``offload_param`` to ``cpu`` or ``nvme``) and a host runs more than one
rank: the CPU optimizer step and the host copies of every rank then compete for the same cores, and DeepSpeed
measured 15-23% shorter steps with binding (docs/performance.md has dsrun's figures). When the launching
process may run on fewer cores than a host has ranks (``taskset``, a container's cpuset) the default does not
bind and says so; ``false`` turns it off, ``true`` binds any run (and refuses a split with an empty share).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Collection, Sequence

NODE_ROOT = Path("/sys/devices/system/node")


def _parse_cpulist(text: str) -> list[int]:
    cores: list[int] = []
    for item in text.strip().split(","):
        if not item:
            continue
        low, _, high = item.partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    return cores


def numa_nodes(root: Path = NODE_ROOT) -> list[list[int]]:
    """Each NUMA node's cores (``nodeN/cpulist``), in node order; nodes without cores are left out, and no node
    at all where the folder is missing (not Linux, or a container that hides it)."""
    nodes: list[tuple[int, list[int]]] = []
    for path in root.glob("node[0-9]*"):
        try:
            cores = _parse_cpulist((path / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if cores:
            nodes.append((int(path.name[4:]), cores))
    return [cores for _, cores in sorted(nodes)]


def cores_for_ranks(local_world_size: int, core_list: Sequence[int] | None = None,
                    nodes: Sequence[Sequence[int]] | None = None,
                    available: Collection[int] | None = None) -> list[list[int]]:
    """The cores of each local rank (see the module docstring); ``nodes`` defaults to :func:`numa_nodes`,
    ``available`` to ``os.sched_getaffinity(0)``. Raises ValueError when there are fewer cores than ranks."""
    if core_list:
        return _split(sorted(core_list), local_world_size)
    available = set(os.sched_getaffinity(0) if available is None else available)
    node_cores = [[c for c in node if c in available] for node in (numa_nodes() if nodes is None else nodes)]
    node_cores = [cores for cores in node_cores if cores]
    if len(node_cores) > 1 and local_world_size % len(node_cores) == 0:
        per_node = local_world_size // len(node_cores)
        if all(len(cores) >= per_node for cores in node_cores):
            return [share for cores in node_cores for share in _split(cores, per_node)]
    return _split(sorted(available), local_world_size)


def _split(cores: list[int], ranks: int) -> list[list[int]]:
    per_rank = len(cores) // ranks
    if per_rank < 1:
        raise ValueError(f"{len(cores)} cores cannot be split among {ranks} ranks on this node (binding gives each "
                         "rank at least one core of its own): start fewer ranks per node, list more cores in "
                         "bind_core_list, or leave bind_cores_to_rank off")
    return [cores[i * per_rank:(i + 1) * per_rank] for i in range(ranks)]


def describe(groups: Sequence[Sequence[int]]) -> str:
    """``local rank 0: cores 0-7; local rank 1: cores 8-15``."""
    return "; ".join(f"local rank {rank}: cores {_ranges(cores)}" for rank, cores in enumerate(groups))


def _ranges(cores: Sequence[int]) -> str:
    spans: list[list[int]] = []
    for core in sorted(cores):
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(f"{low}-{high}" if high > low else str(low) for low, high in spans)


def offloads(ds: object) -> bool:
    """Whether a DeepSpeed config (:class:`~dsrun.config.DSConfig`) offloads optimizer state or parameters."""
    zero = getattr(ds, "zero_optimization", None)
    for section in (getattr(zero, "offload_optimizer", None), getattr(zero, "offload_param", None)):
        device = getattr(section, "device", None)
        if str(getattr(device, "value", device) or "none") in ("cpu", "nvme"):
            return True
    return False


def binds_by_default(ds: object, ranks_per_host: int) -> bool:
    """``dsrun train``'s default for ``launcher.bind_cores_to_rank: null``: an offload run with more than one rank
    on a host."""
    return ranks_per_host > 1 and offloads(ds)
