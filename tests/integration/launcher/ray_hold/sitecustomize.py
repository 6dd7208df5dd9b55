"""The drain test's hold (tests/integration/launcher/test_ray.py), on the node it drains only: that node's raylet
has this folder first on ``PYTHONPATH``, so every Python process Ray starts there runs this file as it starts
(Python's ``sitecustomize``). Where ``DSRUN_TEST_HOLD_AT`` is set and the process imports ``dsrun.run_book`` (the
ranks of ``dsrun train launcher=ray``), the rank notes in ``events_rank<R>.jsonl`` of its run directory where it
started (Ray's node, the checkpoint Ray started it from), holds at the start of step ``DSRUN_TEST_HOLD_AT`` until
Ray's preemption notice has reached the ranks (the test drains the node once they wait there, so the notice comes at
that step's boundary and not at another one) and notes the step its ranks stopped at, with rank 0's
``preempted.json`` record. Nothing else changes; a process that never imports ``dsrun.run_book`` is untouched."""
from __future__ import annotations

import importlib.abc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HOLD_AT = "DSRUN_TEST_HOLD_AT"
HOLD_TIMEOUT_S = 240.0


def note(book: Any, event: str, **fields: Any) -> None:
    with (Path(book.run_dir) / f"events_rank{book.rank}.jsonl").open("a") as out:
        out.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


def hold_in(run_book: Any, hold_at: int) -> None:
    """Wrap ``RunBook.step_begins`` / ``step_ends`` of the module ``run_book`` with the notes and the hold."""
    import ray
    import ray.train

    begins, ends = run_book.RunBook.step_begins, run_book.RunBook.step_ends
    started: list[bool] = []

    def step_begins(book: Any) -> None:
        begins(book)
        if not started:  # this rank's first step
            started.append(True)
            restored = ray.train.get_checkpoint()
            note(book, "start", node=ray.get_runtime_context().get_node_id(),
                 restored=Path(restored.path).name if restored is not None else None)
        if book.last_step_done + 1 == hold_at:
            note(book, "waiting", step=hold_at)
            until = time.monotonic() + HOLD_TIMEOUT_S
            # a barrier across the workers answering rank 0's view: both ranks leave this loop at the same call
            while ray.train.get_preemption_info() is None:
                if time.monotonic() > until:
                    raise RuntimeError(f"no preemption notice from Ray within {HOLD_TIMEOUT_S:g} s of the drain "
                                       "test's hold")
                time.sleep(0.1)

    def step_ends(book: Any, step: int, loss: float) -> bool:
        stopped = ends(book, step, loss)
        if stopped:
            note(book, "stopped", step=step, record=book.preempted)
        return stopped

    run_book.RunBook.step_begins, run_book.RunBook.step_ends = step_begins, step_ends


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``dsrun.run_book`` as the other finders do and wraps its loading: the hold goes in once it ran."""

    def __init__(self, hold_at: int) -> None:
        self.hold_at = hold_at

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "dsrun.run_book":
            return None
        sys.meta_path.remove(self)  # once
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                load = spec.loader.exec_module

                def exec_module(module: Any) -> None:
                    load(module)
                    hold_in(module, self.hold_at)

                spec.loader.exec_module = exec_module
                return spec
        return None


if os.environ.get(HOLD_AT):
    sys.meta_path.insert(0, _AfterImport(int(os.environ[HOLD_AT])))
