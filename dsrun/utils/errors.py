"""User-facing errors.

A :class:`UserError` is a mistake the user can fix (a bad key, a missing file, an inconsistent batch size).
The CLI prints each of its problems on one line and exits with code 2, with no traceback unless
``--debug`` or ``HYDRA_FULL_ERROR=1`` is set. Anything else that escapes is a bug in dsrun and keeps its
traceback.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

EXIT_USAGE = 2


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the user's input.

    ``path`` names where (a dotted key path such as ``ds.zero_optimization.stage``, a file, a CLI flag);
    ``message`` says what is wrong and what is allowed; ``hint`` suggests a fix.
    """

    path: str
    message: str
    hint: str = ""

    def __str__(self) -> str:
        text = f"{self.path}: {self.message}" if self.path else self.message
        if self.hint:
            text += f" ({self.hint})"
        return text


class UserError(Exception):
    """One or more problems with the user's input; the CLI exits with code 2."""

    def __init__(self, problems: Iterable[Problem] | Problem | str):
        if isinstance(problems, (Problem, str)):
            problems = [problems]
        self.problems: list[Problem] = [p if isinstance(p, Problem) else Problem("", p) for p in problems]
        if not self.problems:
            raise ValueError("UserError needs at least one problem")
        super().__init__("\n".join(str(p) for p in self.problems))


class ConfigError(UserError, ValueError):
    """The configuration is invalid. Also a ValueError, as DeepSpeed raises for bad configs."""


class ZeRORuntimeException(ConfigError):
    """DeepSpeed's ``runtime.zero.utils.ZeRORuntimeException``: what ZeRO refuses at ``initialize``, e.g. offloading
    a client optimizer that is not a DeepSpeed CPU optimizer while ``zero_force_ds_cpu_optimizer`` is on. A
    ConfigError too (one line, exit code 2)."""


def show(value: object, limit: int = 60) -> str:
    """Render a user's value (any object) for an error message, shortened if long."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def find_user_error(exc: BaseException) -> UserError | None:
    """The :class:`UserError` that ``exc`` is or was raised from (``hydra.utils.instantiate`` wraps the
    errors of the constructors it calls), else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, UserError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
