"""What the passes plan with (DeepSpeed's ``deepspeed.compile.profilers``): one :class:`ProfilingResult` per graph."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ProfilingResult:
    """A graph's forward and backward graphs and their memory records ``(node, resident bytes after it, change,
    peak while it ran)`` (:func:`.graph_profile.memory_records`). ``*_complete``: the record covers every node
    (a backward that ran only in part leaves it False, and the planning passes skip)."""

    fwd_graph: Any = None
    bwd_graph: Any = None
    needs_backward: bool = False
    fwd_mem: list[tuple[str, int, int, int]] = field(default_factory=list)
    bwd_mem: list[tuple[str, int, int, int]] = field(default_factory=list)
    fwd_mem_complete: bool = True
    bwd_mem_complete: bool = True
    param_indices: list[tuple[int, int, Any]] = field(default_factory=list)  # (input index, ds_id, ds_shape)
    num_fwd_outputs: int | None = None  # the forward's outputs the caller receives (the rest are saved); None: unknown
    bwd_time: list[tuple[str, float, float]] = field(default_factory=list)  # (node, device ms, wall ms): not timed
