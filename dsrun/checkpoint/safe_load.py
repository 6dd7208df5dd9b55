"""Loading checkpoint files without running code from them.

Every file goes through ``torch.load(weights_only=True)``: only tensors, containers, numbers, strings and the
globals on the allow-list can be unpickled. dsrun writes nothing else (RNG states are stored as tensors and
tuples, configs as plain dicts) but the few helper classes DeepSpeed's own files pickle (its loss scaler,
``ZeroStageEnum``, ``fragment_address``), which are mapped by name to inert stand-ins
(``zero_to_fp32.DEEPSPEED_GLOBALS``) so a DeepSpeed checkpoint loads too; the list is short; :func:`add_safe_globals` extends it for a user's own
``client_state`` types. A file that needs anything more fails with :class:`UnsafeCheckpointError`.

torch.load does not check the CRC32 torch.save stores for every record of its zip format: a flipped byte in a
tensor loads as a wrong value. :func:`load_file` checks them before a whole load (:func:`check_records`; a file
written with torch's CRC32 off, every CRC 0, has none to check) and names the first damaged record in one line.
"""
from __future__ import annotations

import collections
import os
import zipfile
from typing import Any, Callable, Union

import torch

from dsrun.io.zip_crc import crc32_mismatches
from dsrun.utils.errors import Problem, UserError
from dsrun.utils.zero_to_fp32 import DEEPSPEED_GLOBALS, corrupt_reason

# torch.load's map_location: a device (or its name), a {from: to} mapping, or a function of (storage, location)
MapLocation = Union[str, torch.device, dict[str, str], Callable[[torch.Tensor, str], torch.Tensor], None]

_ALLOWED: list[Any] = [collections.OrderedDict, torch.Size]


class CorruptCheckpointError(UserError):
    """A checkpoint file is truncated, empty or otherwise damaged."""


class UnsafeCheckpointError(UserError):
    """A checkpoint file holds pickled objects outside the allow-list (loading it could execute code)."""


def add_safe_globals(*objects: Callable[..., object]) -> None:
    """Allow these classes/functions in checkpoint files (for your own types in ``client_state``)."""
    _ALLOWED.extend(objects)


def safe_globals() -> list[Any]:
    return list(_ALLOWED) + list(DEEPSPEED_GLOBALS)


def check_records(path: str | os.PathLike) -> None:
    """Raise :class:`CorruptCheckpointError` naming the first record of the zip-format file ``path`` whose bytes
    do not match its stored CRC32 (torch.load never checks them); a legacy-format file has none to check."""
    if not zipfile.is_zipfile(path):
        return
    try:
        bad = crc32_mismatches(path)
    except ValueError as exc:  # the zip structure itself: torch.load's own error says it no better
        raise CorruptCheckpointError(Problem(str(path), f"cannot read this checkpoint file: {exc}",
                                             "resume from another tag, or start fresh")) from None
    if bad:
        name, stored, computed = bad[0]
        more = f" and {len(bad) - 1} more record(s)" if len(bad) > 1 else ""
        raise CorruptCheckpointError(Problem(str(path), f"record {name}{more} fails its CRC32 check (stored "
                                             f"{stored:#010x}, the bytes give {computed:#010x}): the file is damaged",
                                             "resume from another tag, or start fresh"))


def load_file(path: str | os.PathLike, map_location: MapLocation = "cpu") -> Any:
    """Load one checkpoint file with ``weights_only=True`` and the allow-list. A whole load (any
    ``map_location`` but ``"meta"``, which reads only the index) first checks every record's CRC32."""
    try:
        if map_location != "meta":
            check_records(path)
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except CorruptCheckpointError:
        raise
    except Exception as exc:
        reason = corrupt_reason(str(path), exc)
        if reason is not None:
            raise CorruptCheckpointError(Problem(str(path), f"cannot read this checkpoint file: {reason}",
                                                 "resume from another tag, or start fresh")) from None
        text = str(exc)
        if "weights_only" in text or "Unsupported global" in text or "Unpickl" in type(exc).__name__:
            first = next((line for line in text.splitlines() if "GLOBAL" in line or "global" in line), text[:200])
            raise UnsafeCheckpointError(Problem(
                str(path), f"refusing to load: it holds objects outside the allow-list ({first.strip()})",
                "loading it could execute code; if you trust the file and the type is yours, register it with "
                "dsrun.checkpoint.add_safe_globals(YourType)")) from None
        raise
