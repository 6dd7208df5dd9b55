"""What the support ledger (:mod:`.ledger`) says about one config: the keys it enables that dsrun does not
implement, the refusal or warning lines for them, and ``--explain`` / the generated docs table.

A key is *enabled* when its value differs from the schema's default (or the entry's own ``active`` test
says so) and every section gate above it is on: a section with ``enabled: false`` (compression techniques:
``shared_parameters.enabled``) is silent whatever it holds, as in DeepSpeed, and ``sparse_attention`` is
on by being present. One line per feature: when a whole enabled section is not implemented, its gate key
is named once (the innermost one: ``...random_ltd.enabled``, not ``data_efficiency.enabled``).

:func:`check_support` runs inside :func:`dsrun.config.load_ds_config`, so ``dsrun config --validate``,
``dsrun train`` (and ``--dry-run``), ``dsrun launch`` and ``dsrun.initialize`` give the same verdict.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator

from pydantic import BaseModel

from dsrun.utils.errors import Problem, UserError, show
from dsrun.utils.suggest import did_you_mean

from dsrun.config.ledger import LEDGER, Entry, Feature, Status
from dsrun.config.ledger.entry import NOT_IMPLEMENTED
from dsrun.config.base import RawValue
from dsrun.config.model import DSConfig
from dsrun.config.schema_keys import WILDCARD, mapped_section_model, match_pattern, schema_keys

ALLOW_KEY = "dsrun_allow_unimplemented"
# Sections DeepSpeed turns on by their presence (no "enabled" key), by their paths.
PRESENCE_GATES = ("sparse_attention", "zero_optimization.zenflow", "checkpoint.writer")
# Keys already announced as warnings to this process's parent (dsrun train / launch), not repeated by ranks.
ANNOUNCED_ENV = "DSRUN_UNIMPLEMENTED_ANNOUNCED"


@dataclass(frozen=True)
class _Gate:
    path: str  # the gate key (``x.enabled``) or, for a presence gate, the section
    pattern: str
    section: str  # the section the gate switches, as a path prefix ("x." )

    @property
    def status(self) -> Status:
        if self.pattern in LEDGER:
            return LEDGER[self.pattern].status
        inner = [e.status for k, e in LEDGER.items() if k.startswith(self.section)]
        return Status.NOT_IMPLEMENTED if inner and all(s == Status.NOT_IMPLEMENTED for s in inner) \
            else Status.IMPLEMENTED

    @property
    def entry(self) -> Entry:
        if self.pattern in LEDGER:
            return LEDGER[self.pattern]
        # a presence gate: the section itself, named by the feature of its keys
        feature = next(e for k, e in LEDGER.items() if k.startswith(self.section)).feature
        assert feature is not None
        return Entry(self.path, Status.NOT_IMPLEMENTED, feature.name, feature=Feature("", feature.advice))


@dataclass(frozen=True)
class Unimplemented:
    """A not-implemented key (or whole feature section) that a config enables."""

    path: str
    entry: Entry

    @property
    def text(self) -> str:
        meaning, feature = self.entry.meaning, self.entry.feature
        name = feature.name if feature else ""
        what = meaning if not name or name in meaning or meaning in name else f"{meaning} ({name})"
        return f"{NOT_IMPLEMENTED}: {what}"

    def problem(self, prefix: str) -> Problem:
        advice = self.entry.feature.advice if self.entry.feature else ""
        hint = f"{advice}; or " if advice else ""
        return Problem(f"{prefix}{self.path}", self.text,
                       f"{hint}set {prefix}{ALLOW_KEY}: true to run without it, with a warning")

    def warning(self, prefix: str) -> str:
        return (f"warning: {prefix}{self.path}: {self.text}; the run goes on WITHOUT it "
                f"({prefix}{ALLOW_KEY} is true)")


def _own_gate(section: BaseModel, pattern: str, path: str) -> tuple[_Gate, bool] | None:
    fields = type(section).model_fields
    if "enabled" in fields and isinstance(getattr(section, "enabled"), bool):
        # a section another switch also turns on (compile: engine.compile() with deepcompile, enabled unset)
        on = section.enabled or any(getattr(section, f) for f in getattr(type(section), "also_enabled_by", ()))
        return _Gate(f"{path}enabled", f"{pattern}enabled", path), bool(on)
    shared = getattr(section, "shared_parameters", None) if "shared_parameters" in fields else None
    if isinstance(shared, BaseModel) and "enabled" in type(shared).model_fields:
        return _Gate(f"{path}shared_parameters.enabled", f"{pattern}shared_parameters.enabled", path), \
            bool(shared.enabled)
    return None


def _leaves(section: BaseModel, pattern: str, path: str, chain: tuple[_Gate, ...]
            ) -> Iterator[tuple[str, str, tuple[_Gate, ...], Any]]:
    """(path, pattern, gates above, value) of every leaf under switched-on gates."""
    gate = _own_gate(section, pattern, path)
    if gate is not None:
        if not gate[1]:
            return
        chain = (*chain, gate[0])
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        sub_pattern, sub_path = f"{pattern}{name}", f"{path}{name}"
        if sub_pattern in PRESENCE_GATES:
            if value is None:
                continue
            presence = _Gate(sub_path, sub_pattern, f"{sub_path}.")
            yield sub_path, sub_pattern, (*chain, presence), True
            yield from _leaves(value, f"{sub_pattern}.", f"{sub_path}.", (*chain, presence))
        elif isinstance(value, BaseModel):
            yield from _leaves(value, f"{sub_pattern}.", f"{sub_path}.", chain)
        elif isinstance(value, dict) and mapped_section_model(field.annotation) is not None:
            for key, item in value.items():
                yield from _leaves(item, f"{sub_pattern}.{WILDCARD}.", f"{sub_path}.{key}.", chain)
        else:
            yield sub_path, sub_pattern, chain, value


def _enabled(cfg: DSConfig, pattern: str, value: RawValue, entry: Entry) -> bool:
    if entry.applies is not None and not entry.applies(cfg):
        return False
    if entry.active is not None:
        return bool(entry.active(cfg))
    key = schema_keys(DSConfig).get(pattern)
    return key is None or value != key.default


def unimplemented_keys(cfg: DSConfig) -> list[Unimplemented]:
    """The not-implemented keys a loaded config enables, one per feature section or key."""
    found: dict[str, Unimplemented] = {}
    sections: dict[str, str] = {}  # reported gate path -> the section it switches
    for path, pattern, chain, value in _leaves(cfg, "", "", ()):
        if pattern in PRESENCE_GATES:
            gate = chain[-1]
            if gate.status == Status.NOT_IMPLEMENTED:
                found[path], sections[path] = Unimplemented(path, gate.entry), gate.section
            continue
        entry = LEDGER.get(pattern)
        if entry is None or entry.status != Status.NOT_IMPLEMENTED or not _enabled(cfg, pattern, value, entry):
            continue
        gate = next((g for g in reversed(chain) if g.status == Status.NOT_IMPLEMENTED), None)
        if gate is None:
            found.setdefault(path, Unimplemented(path, entry))
        else:
            found.setdefault(gate.path, Unimplemented(gate.path, gate.entry))
            sections[gate.path] = gate.section
    # an enabled section with a reported section inside it: the inner one says more
    return [u for p, u in found.items()
            if not (p in sections and any(q != p and q.startswith(sections[p]) for q in found))]


def refused_values(cfg: DSConfig, prefix: str) -> list[Problem]:
    """Values of implemented keys dsrun cannot run (1-bit and mup optimizers); refused in every mode."""
    problems = []
    for path, pattern, _, value in _leaves(cfg, "", "", ()):
        entry = LEDGER.get(pattern)
        if entry is None or not entry.refused_values:
            continue
        for item in value if isinstance(value, list) else [value]:  # a list key: each of its values
            if isinstance(item, str) and item.lower() in entry.refused_values:
                problems.append(Problem(f"{prefix}{path}", f"got {show(item)}: {entry.refused_values[item.lower()]}"))
    return problems


def check_support(cfg: DSConfig, prefix: str = "") -> tuple[list[Problem], list[Unimplemented]]:
    """(problems, allowed) for a loaded config: refusals of what it enables and dsrun lacks, or, with
    ``dsrun_allow_unimplemented``, those keys in ``allowed`` (to be warned about) instead."""
    missing = unimplemented_keys(cfg)
    problems = refused_values(cfg, prefix)
    if getattr(cfg, ALLOW_KEY, False):
        return problems, missing
    return problems + [u.problem(prefix) for u in missing], []


def announce(cfg: DSConfig, *, rank: int | None = None, for_children: bool = False) -> list[str]:
    """Print the warning lines of a config loaded with ``dsrun_allow_unimplemented`` (what the run goes on
    without) on stderr, once per run: only on rank 0 (``rank``, else ``$RANK``), and not the keys a launching
    dsrun command already printed. ``for_children``: record the keys for the processes started from here
    (``dsrun train`` and ``dsrun launch`` before they launch ranks). Returns the lines printed."""
    rank = int(os.environ.get("RANK") or 0) if rank is None else rank
    done = set(filter(None, os.environ.get(ANNOUNCED_ENV, "").split(",")))
    printed = []
    if rank == 0:
        for key, line in zip(cfg.unimplemented, cfg.unimplemented_warnings):
            if key not in done:
                print(line, file=sys.stderr, flush=True)
                printed.append(line)
    if for_children and cfg.unimplemented:
        os.environ[ANNOUNCED_ENV] = ",".join(sorted(done | set(cfg.unimplemented)))
    return printed


# --- explain and the docs table ------------------------------------------------------------------------------
def _status_text(entry: Entry) -> str:
    if entry.status == Status.IMPLEMENTED:
        return "implemented (proof: " + ", ".join(entry.proof) + ")"
    if entry.status == Status.BY_DESIGN:
        return f"no effect by design: {entry.reason}"
    feature = entry.feature
    return "not implemented: refused when enabled" + (f" ({feature.name})" if feature and feature.name else "")


def explain(key: str) -> str:
    """``dsrun config --explain KEY``: the key's type, default, status and meaning."""
    path = key[3:] if key.startswith("ds.") else key
    keys = schema_keys(DSConfig)
    pattern = match_pattern(path, keys) or match_pattern(path, LEDGER)
    if pattern is None:
        raise UserError(Problem(key, "not a key of the DeepSpeed config schema",
                                did_you_mean(path, list(keys)) or "see docs/config_support.md for every key"))
    entry = LEDGER[pattern]
    schema_key = keys[pattern]
    lines = [f"key      {pattern}", f"type     {schema_key.type_text}", f"default  {schema_key.default!r}",
             f"status   {_status_text(entry)}", f"meaning  {entry.meaning}"]
    if entry.status == Status.NOT_IMPLEMENTED and entry.feature and entry.feature.advice:
        lines.append(f"instead  {entry.feature.advice}")
    return "\n".join(lines)


def status_counts() -> dict[str, int]:
    counts = {status.value: 0 for status in Status}
    for entry in LEDGER.values():
        counts[entry.status.value] += 1
    return counts


def render_markdown() -> str:
    """docs/config_support.md: every key with its default, status and meaning, generated from the ledger."""
    keys = schema_keys(DSConfig)
    counts = status_counts()
    out = [
        "# Support ledger: what every DeepSpeed config key does in dsrun",
        "",
        "Generated from `dsrun/config/ledger/` by `python -m dsrun config --support-table > docs/config_support.md`;",
        "`tests/unit/config/test_support_ledger.py` fails when this file and the ledger differ. How statuses",
        "are decided, what is refused and how to flip a key: [config.md](config.md#the-support-ledger).",
        "",
        f"{len(LEDGER)} keys: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".",
        "",
    ]
    groups: dict[str, list[str]] = {"top-level keys": []}
    for pattern in [*keys, *(k for k in LEDGER if k not in keys)]:  # the schema's order
        groups.setdefault(pattern.split(".")[0] if "." in pattern else "top-level keys", []).append(pattern)
    for section, patterns in groups.items():
        out += ["", f"## {section}", "", "| key | default | status | meaning | proof or reason |", "|---|---|---|---|---|"]
        for pattern in patterns:
            entry = LEDGER[pattern]
            default = keys[pattern].default if pattern in keys else None
            if entry.status == Status.IMPLEMENTED:
                why = "<br>".join(f"`{p}`" for p in entry.proof)
            elif entry.status == Status.BY_DESIGN:
                why = entry.reason
            else:
                why = entry.feature.name if entry.feature and entry.feature.name else ""
            cells = [f"`{pattern}`", f"`{default!r}`", entry.status.value, entry.meaning, why]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"
