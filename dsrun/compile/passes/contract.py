"""What each DeepCompile pass needs and gives (DeepSpeed's ``deepspeed.compile.passes.contract``).

A schedule is DeepSpeed's ``[(step, [pass, ...]), ...]``: at ``step`` the graphs are compiled again from dynamo's
capture with those passes, left to right. :func:`validate_schedule` refuses a schedule before it runs: a pass
listed before every capability it ``requires`` was ``provides``-d by an earlier pass *of the same step* (each
step starts from the uncompiled graph, so nothing carries over), or two passes where either names the other in
``conflicts_with``. A pass without a registered contract is unconstrained, but a conflict naming it still holds.
Passes may be named or given as callables; a callable is found by identity in the ``{name: fn}`` registry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

CAP_Z3_GATHER_RELEASE = "z3_gather_release"  # ZeRO-3's gather/release ops are in the graph
CAP_OPT_STATES_EVICTED = "opt_states_evicted"  # optimizer states left the device before the profile


@dataclass(frozen=True)
class PassContract:
    """``provides``/``requires``: capability tags; ``conflicts_with``: pass names; ``phase``: which graph the
    pass rewrites ("forward", "backward" or "both"; documentation only)."""

    provides: frozenset[str] = frozenset()
    requires: frozenset[str] = frozenset()
    conflicts_with: frozenset[str] = frozenset()
    phase: str = "both"


class PassContractError(ValueError):
    """A schedule breaks a pass's contract (a requirement not met in its step, or two conflicting passes)."""


_pass_contracts: dict[str, PassContract] = {}
_NO_CONTRACT = PassContract()


def register_pass_contract(name: str, contract: PassContract | None) -> None:
    """Register ``contract`` for pass ``name``; None removes the one registered before."""
    if contract is None:
        _pass_contracts.pop(name, None)
    else:
        _pass_contracts[name] = contract


def get_pass_contract(name: str) -> PassContract | None:
    return _pass_contracts.get(name)


def pass_name(pass_ref: str | Callable, name_registry: Mapping[str, Callable] | None) -> str | None:
    """The registered name of ``pass_ref`` (a name, or a callable found by identity); None when unknown."""
    if isinstance(pass_ref, str):
        return pass_ref
    names = sorted(name for name, fn in (name_registry or {}).items() if fn is pass_ref)
    if len(names) > 1:
        raise PassContractError(f"the pass callable is registered under multiple names {names}: name it in the "
                                "schedule so its contract is known")
    return names[0] if names else None


def validate_schedule(schedule: Iterable[tuple[int, list]], name_registry: Mapping[str, Callable] | None = None) -> None:
    """Raise :class:`PassContractError` at the first unmet requirement or conflict of ``schedule``."""
    for step, passes in schedule:
        provided: set[str] = set()
        earlier: list[str] = []
        for pass_ref in passes:
            name = pass_name(pass_ref, name_registry)
            if name is None:
                continue
            contract = _pass_contracts.get(name, _NO_CONTRACT)
            missing = sorted(contract.requires - provided)
            if missing:
                raise PassContractError(f"pass '{name}' at step {step} requires {missing}, which no earlier pass of "
                                        f"that step provides (before it: {earlier})")
            clashes = sorted({prev for prev in earlier if prev in contract.conflicts_with
                              or name in _pass_contracts.get(prev, _NO_CONTRACT).conflicts_with})
            if clashes:
                raise PassContractError(f"pass '{name}' at step {step} conflicts with {clashes} in the same step")
            provided |= contract.provides
            earlier.append(name)
