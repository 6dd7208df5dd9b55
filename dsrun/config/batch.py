"""The batch-size triad: any two of train_batch_size, train_micro_batch_size_per_gpu and
gradient_accumulation_steps give the third, for a world size W (the data-parallel size).

The arithmetic is DeepSpeed's (config-keys.md §5): integer division to infer, then an exact equality
check ``train_batch_size == micro * gas * W`` and all three > 0. Where DeepSpeed fails a bare assert, dsrun
reports the arithmetic and where W came from.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsrun.utils.errors import Problem

TBS = "train_batch_size"
MBS = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchResolution:
    """The three resolved numbers and a sentence per number saying where it came from."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    explanation: str


def _world(world_size: int, world_size_source: str) -> str:
    return f"world size {world_size}, from {world_size_source}"


def resolve_batch(
    tbs: int | None,
    mbs: int | None,
    gas: int | None,
    world_size: int,
    world_size_source: str = "default",
    prefix: str = "",
) -> tuple[BatchResolution | None, list[Problem]]:
    """Fill in the missing batch numbers as DeepSpeed does and check the equality.

    Returns the resolution, or None and the problems (each naming the key to change).
    """
    w = world_size
    where = _world(w, world_size_source)
    origin = {TBS: "given", MBS: "given", GAS: "given"}
    if w < 1:
        # The world size is not a config key; the problem names it by itself.
        return None, [Problem("world_size", f"got {w}; the world size must be >= 1 ({where})")]
    if tbs is not None and mbs is not None and gas is not None:
        pass
    elif tbs is not None and mbs is not None:
        gas = tbs // mbs // w
        origin[GAS] = f"inferred: {TBS} // {MBS} // world size = {tbs} // {mbs} // {w}"
    elif tbs is not None and gas is not None:
        mbs = tbs // w // gas
        origin[MBS] = f"inferred: {TBS} // world size // {GAS} = {tbs} // {w} // {gas}"
    elif mbs is not None and gas is not None:
        tbs = mbs * gas * w
        origin[TBS] = f"inferred: {MBS} * {GAS} * world size = {mbs} * {gas} * {w}"
    elif tbs is not None:
        gas = 1
        mbs = tbs // w
        origin[GAS] = "default 1 (only train_batch_size given)"
        origin[MBS] = f"inferred: {TBS} // world size = {tbs} // {w}"
    elif mbs is not None:
        gas = 1
        tbs = mbs * w
        origin[GAS] = f"default 1 (only {MBS} given)"
        origin[TBS] = f"inferred: {MBS} * world size = {mbs} * {w}"
    else:
        return None, [Problem(
            f"{prefix}{TBS}",
            f"either {TBS} or {MBS} must be given (gradient_accumulation_steps alone does not fix the batch)",
            f"add e.g. \"{MBS}\": 1",
        )]
    assert tbs is not None and mbs is not None and gas is not None

    problems: list[Problem] = []
    for key, value in ((TBS, tbs), (MBS, mbs), (GAS, gas)):
        if value <= 0:
            problems.append(Problem(
                f"{prefix}{key}",
                f"resolved to {value}, must be > 0 ({origin[key]}; {where})",
                "train_batch_size must be at least micro batch * world size" if origin[key] != "given" else "",
            ))
    if problems:
        return None, problems
    product = mbs * gas * w
    if tbs != product:
        inferred = [k for k in (TBS, MBS, GAS) if origin[k] != "given"]
        note = f"; {inferred[0]} was {origin[inferred[0]]}" if inferred else ""
        step = mbs * w
        lower, upper = (tbs // step) * step, (tbs // step + 1) * step
        choices = sorted({v for v in (lower, upper) if v > 0})
        hint = (f"{TBS} must be a multiple of {MBS} * world size = {mbs} * {w} = {step}, "
                f"e.g. {' or '.join(str(c) for c in choices)}")
        return None, [Problem(
            f"{prefix}{TBS}",
            f"{TBS} {tbs} != {MBS} {mbs} * {GAS} {gas} * world size {w} = {product} ({where}{note})",
            hint,
        )]
    lines = [
        f"{TBS} = {tbs} ({origin[TBS]})",
        f"{MBS} = {mbs} ({origin[MBS]})",
        f"{GAS} = {gas} ({origin[GAS]})",
        f"{where}; check: {mbs} * {gas} * {w} = {product}",
    ]
    return BatchResolution(tbs, mbs, gas, "\n".join(lines)), []
