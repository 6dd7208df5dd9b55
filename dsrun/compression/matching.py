"""Which modules a compression group names.

A group's ``modules`` are patterns: ``"*"`` names every eligible module, anything else is a regular
expression searched in the module's dotted name (``re.search``, as DeepSpeed does; ``"attention.self"``
matches ``bert.encoder.layer.0.attention.self.query``). A module already claimed by an earlier group of the
same technique stays with that group. ``related_modules[i]`` lists patterns for the modules that follow
``modules[i]``'s (the next Linear, the Q/K/V of an attention output, the next Conv2d and its BatchNorm);
their matches pair with ``modules[i]``'s in order.
"""
from __future__ import annotations

import re

from torch import nn

from dsrun.utils.errors import Problem, UserError


def matches(pattern: str, name: str) -> bool:
    return pattern == "*" or re.search(pattern, name) is not None


def _compile_check(pattern: str, where: str) -> None:
    if pattern == "*":
        return
    try:
        re.compile(pattern)
    except re.error as exc:
        raise UserError(Problem(where, f"{pattern!r} is not a regular expression ({exc})",
                                "use '*' for every module, or a name fragment such as 'attn.c_proj'")) from None


def select(model: nn.Module, patterns: list[str], eligible: tuple[type, ...], claimed: set[str],
           where: str, excluded: list[str] | None = None) -> list[list[str]]:
    """For each pattern, the names of the eligible, unclaimed, not excluded modules it matches (in model
    order); they are added to ``claimed``. A pattern other than ``*`` that matches no eligible module is an
    error (a typo would otherwise compress nothing)."""
    found: list[list[str]] = []
    for i, pattern in enumerate(patterns):
        _compile_check(pattern, f"{where}.modules[{i}]")
        names = []
        any_match = False
        for name, module in model.named_modules():
            if not name or not isinstance(module, eligible) or not matches(pattern, name):
                continue
            any_match = True
            if name in claimed or any(re.search(x, name) for x in excluded or []):
                continue
            claimed.add(name)
            names.append(name)
        if not any_match and pattern != "*":
            kinds = "/".join(t.__name__ for t in eligible)
            raise UserError(Problem(f"{where}.modules[{i}]", f"{pattern!r} matches no {kinds} module of the model",
                                    f"module names look like {_example_names(model, eligible)}"))
        found.append(names)
    return found


def related(model: nn.Module, owners: list[str], patterns: list[str], eligible: tuple[type, ...],
            where: str) -> list[list[str]]:
    """For each owner, one related module name per pattern (the pattern's matches pair with the owners in
    order)."""
    per_pattern: list[list[str]] = []
    for j, pattern in enumerate(patterns):
        _compile_check(pattern, f"{where}[{j}]")
        names = [n for n, m in model.named_modules() if n and isinstance(m, eligible) and matches(pattern, n)]
        if len(names) != len(owners):
            raise UserError(Problem(f"{where}[{j}]", f"{pattern!r} matches {len(names)} module(s) but the group's "
                                    f"pattern matched {len(owners)}; related modules pair with them in order",
                                    "make the related pattern name exactly one module per pruned module"))
        per_pattern.append(names)
    return [list(group) for group in zip(*per_pattern)] if per_pattern else [[] for _ in owners]


def _example_names(model: nn.Module, eligible: tuple[type, ...]) -> str:
    names = [n for n, m in model.named_modules() if n and isinstance(m, eligible)]
    return ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "") if names else "(none)"
