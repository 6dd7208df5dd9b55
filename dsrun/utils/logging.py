"""``deepspeed.utils.logging``: the ``logger`` DeepSpeed's client code writes to, and ``log_dist``.

The logger is named ``"DeepSpeed"`` (as in DeepSpeed, so a script's ``logging.getLogger("DeepSpeed")`` settings
apply) and prints ``[YYYY-MM-DD HH:MM:SS,ms] [LEVEL] [file:line:func] message`` to stdout at INFO; the config's
``log_level`` sets its level when an engine is built (:func:`set_log_level_from_string`, as DeepSpeed's engine does).
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Iterable

LOGGER_NAME = "DeepSpeed"


def _make_logger() -> logging.Logger:
    log = logging.getLogger(LOGGER_NAME)
    if not log.handlers:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter(
            "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


logger = _make_logger()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the listed ranks only (``[-1]``: every rank; ``None``: none), prefixed ``[Rank N]``.

    Before torch.distributed is initialized the process counts as rank -1 and logs whenever ``ranks`` is given.
    """
    if ranks is None:
        return
    ranks = list(ranks)
    rank = _rank()
    if -1 in ranks or rank in ranks or rank == -1:
        logger.log(level, f"[Rank {rank}] {message}")


def should_log_le(max_log_level_str: str) -> bool:
    """Whether the logger would print a record of level ``max_log_level_str`` ("info", "warning", ...)."""
    level = logging.getLevelName(max_log_level_str.upper())
    if not isinstance(level, int):
        raise ValueError(f"{max_log_level_str} is not one of the logging levels")
    return logger.getEffectiveLevel() <= level


LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "critical": logging.CRITICAL}


def get_log_level_from_string(log_level_str: str) -> int:
    """The ``logging`` level of ``"debug"``, ``"info"``, ``"warning"``, ``"error"`` or ``"critical"`` (any case)."""
    level = LOG_LEVELS.get(log_level_str.lower())
    if level is None:
        raise ValueError(f"{log_level_str} is not one of the log levels {sorted(LOG_LEVELS)}")
    return level


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set ``custom_logger`` (default: the ``DeepSpeed`` logger) and each of its handlers to the level named."""
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    """The ``DeepSpeed`` logger's effective level."""
    return logger.getEffectiveLevel()


def print_configuration(args: Any, name: str) -> None:
    """Log ``name:`` then one ``  attribute ..... value`` line per attribute of ``args`` (``vars(args)``, sorted):
    what DeepSpeed's ``dump_state`` prints of the engine after initialize."""
    logger.info(f"{name}:")
    for key in sorted(vars(args)):
        logger.info(f"  {key} {'.' * (29 - len(key))} {getattr(args, key)}")


def call_to_str(base: str, *args: object, **kwargs: object) -> str:
    """A call as source text for log lines: ``call_to_str("f", 3, "a", val=1)`` is ``f(3, 'a', val=1)``
    (DeepSpeed's ``runtime.utils.call_to_str``)."""
    arguments = [repr(arg) for arg in args] + [f"{key}={value!r}" for key, value in kwargs.items()]
    return f"{base}({', '.join(arguments)})"
