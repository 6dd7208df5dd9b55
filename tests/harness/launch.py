"""Multi-rank launches as records, run once per test module by the one ``runs`` fixture (tests/conftest.py).

A test module declares its launches, ``LAUNCHES = {key: Launch(...)}`` (or ``launches(root)`` returning that
dict for the module's temporary folder, the ``module_root`` fixture), and reads their results from
``runs[key]``: each launch starts on first use and its per-rank results are kept for the session. A module
whose launches depend on each other or whose tests read the results combined declares ``collect(runs)``; the
fixture then gives what it returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from tests.helpers import run_ranks


@dataclass(frozen=True)
class Launch:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks (127.0.0.1, a free port), all killed after
    ``timeout`` seconds; ``rank`` picks one rank's result (None: the list of every rank's, in rank order)."""

    fn: Callable
    world: int
    args: tuple = ()
    timeout: float = 600
    rank: int | None = None

    def __call__(self) -> Any:
        results = run_ranks(self.fn, self.world, *self.args, timeout=self.timeout)
        return results if self.rank is None else results[self.rank]


# results by launch (the record itself, kept alive here): a module that imports another's LAUNCHES shares its runs
_DONE: dict[int, tuple[Launch, Any]] = {}


class Runs:
    """A module's launches, each run once, on first use (``runs[key]``); ``root`` is the module's folder."""

    def __init__(self, launches: Mapping[Any, Launch] | Callable[[Path], Mapping[Any, Launch]], root: Path) -> None:
        self.root = root
        self.launches = launches(root) if callable(launches) else dict(launches)

    def __getitem__(self, key: Any) -> Any:
        launch = self.launches[key]
        if id(launch) not in _DONE:
            _DONE[id(launch)] = (launch, launch())
        return _DONE[id(launch)][1]

    def __call__(self, launch: Launch) -> Any:
        """Run a launch the module did not declare (it depends on an earlier one's results); not kept."""
        return launch()
