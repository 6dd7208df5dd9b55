"""Training progress on rank 0: a rich progress bar when stdout is a terminal, plain log lines otherwise.

The bar shows step/total, loss, learning rate, samples/s, tokens/s, the model's TFLOP/s per device and MFU
(when the model's FLOPs are known: :mod:`dsrun.profiling.mfu`) and the time left; it redraws in place, so it
is only used on a terminal. Anywhere else (CI, a log file, ``dsrun train`` collecting rank logs) a line is
printed every ``print_every`` steps and at the last step::

    [dsrun] step 20/300 | loss 2.4312 | lr 3.000e-04 | 412 samples/s | 52,736 tokens/s | 0.0680 TFLOP/s |
    MFU 66.1% | eta 1m04s     (one line)

``DSRUN_PROGRESS=bar`` or ``lines`` overrides the choice. Under ``dsrun train`` rank 0's stdout is a pipe to
the launcher, so it prints lines (a bar's redraws would reach the terminal as escape codes, line by line).
"""
from __future__ import annotations

import os
import sys
from typing import Any, TextIO

PROGRESS_ENV = "DSRUN_PROGRESS"


def format_seconds(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def format_tflops(tflops: float) -> str:
    """Three significant figures, trailing zeros kept (a CPU's 0.0210, an H100's 412), whole above 1000."""
    return f"{tflops:#.3g}".rstrip(".") if tflops < 1000 else f"{tflops:,.0f}"


def flops_text(tflops: float, mfu: float) -> str:
    """``0.0123 TFLOP/s | MFU 8.1%`` (``mfu`` a fraction of the device's peak)."""
    return f"{format_tflops(tflops)} TFLOP/s | MFU {100 * mfu:.1f}%"


class TrainingProgress:
    """``update()`` once per optimizer step; ``note()`` for one-off lines (evaluations); ``close()`` at the end.

    ``enabled`` False (ranks other than 0) makes every call a no-op. ``bar`` None means ``DSRUN_PROGRESS``
    if set, else "a bar if the stream is a terminal".
    """

    def __init__(self, total_steps: int, enabled: bool = True, print_every: int = 10, bar: bool | None = None,
                 stream: TextIO | None = None, start_step: int = 0):
        self.total = total_steps
        self.start_step = start_step  # steps done before this process started (a resumed run)
        self.enabled = enabled
        self.print_every = max(1, print_every)
        self.stream = stream or sys.stdout
        if bar is None:
            choice = os.environ.get(PROGRESS_ENV, "").lower()
            bar = choice == "bar" if choice in ("bar", "lines") else self.stream.isatty()
        self.use_bar = enabled and bar
        self._bar: Any = None
        self._task: Any = None
        if self.use_bar:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                 TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
                                 console=Console(file=self.stream, force_terminal=True), transient=False)
            self._task = self._bar.add_task("train", total=total_steps, stats="")
            self._bar.start()

    def update(self, step: int, loss: float, lr: float, samples_per_s: float, tokens_per_s: float,
               elapsed_s: float, extra: str = "", tflops: float | None = None, mfu: float | None = None) -> None:
        """``tflops``/``mfu``: the model's TFLOP/s per device and MFU (a fraction), shown when given."""
        if not self.enabled:
            return
        stats = (f"loss {loss:.4f} | lr {lr:.3e} | {samples_per_s:,.0f} samples/s | {tokens_per_s:,.0f} tokens/s")
        if tflops is not None and mfu is not None:
            stats += f" | {flops_text(tflops, mfu)}"
        if self.use_bar:
            self._bar.update(self._task, completed=step, stats=stats + (f" | {extra}" if extra else ""))
            return
        if step % self.print_every == 0 or step == self.total:
            eta = format_seconds(elapsed_s / max(step - self.start_step, 1) * (self.total - step))
            line = f"[dsrun] step {step}/{self.total} | {stats} | eta {eta}" + (f" | {extra}" if extra else "")
            print(line, file=self.stream, flush=True)

    def note(self, text: str) -> None:
        """A line that stays (above the bar on a terminal)."""
        if not self.enabled:
            return
        if self.use_bar:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
