"""One ledger entry: what a config key does in dsrun, and how we know.

Three statuses:

* ``implemented``: the key changes what dsrun does. ``proof`` names the tests (``file::function``) that
  change the key and see the behaviour change; unless ``traced`` is false, the tracer test also sees the
  runtime read it (``tests/unit/config/test_support_ledger.py``).
* ``no effect by design``: accepted and silent; ``reason`` says why nothing needs to happen (few keys).
* ``not implemented``: accepted by the schema; a config that *enables* it (a non-default value, or an
  enabled section) is refused at validation, one line per key, unless ``dsrun_allow_unimplemented`` is true.

``applies`` limits a refusal to the settings where DeepSpeed itself reads the key (a stage-3 key at stage 1
is ignored by DeepSpeed too); ``active`` replaces the "differs from the default" test where that test is not
what enabling means; ``refused_values`` lists values of an implemented key that dsrun cannot run (an
optimizer name), refused whatever ``dsrun_allow_unimplemented`` says.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping

Predicate = Callable[[Any], bool]  # called with the loaded DSConfig
NOT_IMPLEMENTED = "not implemented in this version of dsrun"  # in every refusal the ledger makes


class Status(str, Enum):
    IMPLEMENTED = "implemented"
    BY_DESIGN = "no effect by design"
    NOT_IMPLEMENTED = "not implemented"


@dataclass(frozen=True)
class Feature:
    """A DeepSpeed feature dsrun does not have yet: its name in refusals and what to do instead."""

    name: str
    advice: str = ""


@dataclass(frozen=True)
class Entry:
    key: str
    status: Status
    meaning: str
    proof: tuple[str, ...] = ()
    reason: str = ""
    feature: Feature | None = None
    traced: bool = True
    applies: Predicate | None = None
    active: Predicate | None = None
    refused_values: Mapping[str, str] = field(default_factory=dict)


def done(key: str, meaning: str, *proof: str, traced: bool = True,
         refused_values: Mapping[str, str] | None = None) -> Entry:
    """An implemented key and the tests that prove it (at least one)."""
    return Entry(key, Status.IMPLEMENTED, meaning, proof=tuple(proof), traced=traced,
                 refused_values=dict(refused_values or {}))


def design(key: str, meaning: str, reason: str) -> Entry:
    """A key that is accepted and has no effect in dsrun, for the stated reason."""
    return Entry(key, Status.BY_DESIGN, meaning, reason=reason)


def todo(key: str, meaning: str, feature: Feature, *, applies: Predicate | None = None,
         active: Predicate | None = None) -> Entry:
    """A key dsrun does not implement yet: refused when a config enables it."""
    return Entry(key, Status.NOT_IMPLEMENTED, meaning, feature=feature, applies=applies, active=active)
