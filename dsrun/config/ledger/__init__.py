"""The support ledger: for every key the DeepSpeed config schema accepts, what it does in dsrun.

One entry per schema key (:func:`dsrun.config.schema_keys.schema_keys`), in :mod:`.training` (the training
core), :mod:`.features` (DeepSpeed's training techniques) and :mod:`.recent` (keys DeepSpeed added
after 0.14). Each entry is made by one of:

* ``done(key, meaning, *proof)``: implemented; ``proof`` names the tests that change the key and see the
  behaviour change (``{key}`` in a proof is replaced by the key: one case of a parametrized effect test);
* ``design(key, meaning, reason)``: accepted and without effect, for the reason given;
* ``todo(key, meaning, feature)``: not implemented yet; a config enabling it is refused at validation.

To flip a key when its feature lands, replace its ``todo(...)`` by ``done(key, meaning, proof)`` and add the
proof (docs/config.md, "Flipping a key"); ``tests/unit/config/test_support_ledger.py`` then checks the proof
exists and that the runtime reads the key, and ``docs/config_support.md`` must be regenerated.
"""
from __future__ import annotations

from .entry import Entry, Feature, Status, design, done, todo
from .features import ENTRIES as FEATURE_ENTRIES
from .recent import ENTRIES as RECENT_ENTRIES
from .training import ENTRIES as TRAINING_ENTRIES


def _build() -> dict[str, Entry]:
    ledger: dict[str, Entry] = {}
    for entry in (*TRAINING_ENTRIES, *FEATURE_ENTRIES, *RECENT_ENTRIES):
        if entry.key in ledger:
            raise ValueError(f"support ledger: {entry.key!r} has two entries")
        proof = tuple(p.replace("{key}", entry.key) for p in entry.proof)
        ledger[entry.key] = Entry(**{**entry.__dict__, "proof": proof})
    return ledger


LEDGER: dict[str, Entry] = _build()

__all__ = ["Entry", "Feature", "LEDGER", "Status", "design", "done", "todo"]
