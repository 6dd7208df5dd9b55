"""``deepspeed.launcher.runner``: the functions of DeepSpeed's ``deepspeed`` command, over dsrun's launcher.

``main(args)`` is ``dsrun launch`` with DeepSpeed's flags (an inconsistent set raises ValueError, as DeepSpeed's
does); ``parse_resource_filter``, ``_parse_hostfile``, ``fetch_hostfile``, ``parse_inclusion_exclusion`` and
``encode_world_info`` keep DeepSpeed's signatures and return shapes, with dsrun's checks and messages (raised as
ValueError). One difference from dsrun's own launcher: a filter that leaves no slots returns ``{}`` here (the
launcher refuses it before starting anything).
"""
from __future__ import annotations

import argparse
import os
from typing import Sequence

from dsrun.cli.launch import add_arguments, options_from_args, run
from dsrun.launcher.hostfile import apply_filters, parse_hostfile, read_hostfile
from dsrun.launcher.protocol import encode_world_info  # noqa: F401 - DeepSpeed's name here
from dsrun.utils.errors import UserError

DLTS_HOSTFILE = "/job/hostfile"

_NOTHING_LEFT = "leaves no slots to run on"


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="deepspeed", description="DeepSpeed's launcher flags, run by dsrun")
    add_arguments(parser)
    parser.allow_abbrev = True  # DeepSpeed's parser takes unambiguous prefixes (--launcher_arg); dsrun's does not
    return parser.parse_args(args)


def main(args: Sequence[str] | None = None) -> int:
    """Launch as ``deepspeed ARGS`` would; ValueError listing the problems of an inconsistent flag set."""
    namespace = parse_args(args)
    problems = options_from_args(namespace).problems()
    if problems:
        raise ValueError("; ".join(str(problem) for problem in problems))
    return run(namespace)


def _parse_hostfile(hostfile_lines: Sequence[str]) -> dict[str, int]:
    """``{host: slots}`` from a hostfile's lines (blank lines and ``#`` comments skipped)."""
    try:
        return parse_hostfile("\n".join(hostfile_lines))
    except UserError as error:
        raise ValueError(str(error)) from None


def fetch_hostfile(hostfile_path: str) -> dict[str, int] | None:
    """The hostfile's ``{host: slots}``, or None when there is no such file (one machine)."""
    if not os.path.isfile(hostfile_path):
        return None
    try:
        return read_hostfile(hostfile_path)
    except UserError as error:
        raise ValueError(str(error)) from None


def parse_resource_filter(host_info: dict[str, list[int]], include_str: str = "",
                          exclude_str: str = "") -> dict[str, list[int]]:
    """``host_info`` narrowed by an include or an exclude filter (``"host[:slot,slot][@host...]"``)."""
    try:
        return apply_filters(host_info, include=include_str or None, exclude=exclude_str or None)
    except UserError as error:
        if all(problem.message.endswith(_NOTHING_LEFT) for problem in error.problems):
            return {}
        raise ValueError(str(error)) from None


def parse_inclusion_exclusion(resource_pool: dict[str, int], inclusion: str, exclusion: str) -> dict[str, list[int]]:
    """The active slots of a ``{host: slot count}`` pool after the filters."""
    return parse_resource_filter({host: list(range(slots)) for host, slots in resource_pool.items()},
                                 include_str=inclusion, exclude_str=exclusion)
