"""'Did you mean' suggestions for misspelled names."""
from __future__ import annotations

import difflib
from typing import Iterable


def closest(name: str, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The choice closest to ``name`` (case-insensitive), or None when nothing is close."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=cutoff)
    return lowered[match[0]] if match else None


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A hint such as ``did you mean 'stage'?``, or an empty string."""
    best = closest(name, choices)
    return f"did you mean '{best}'?" if best else ""
