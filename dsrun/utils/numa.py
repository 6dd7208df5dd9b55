"""``deepspeed.utils.numa``: the core-list syntax of ``--bind_core_list`` ("0-3,8,10-11")."""
from __future__ import annotations


def parse_range(rng: str) -> list[int]:
    """``"3"`` -> [3]; ``"2-5"`` -> [2, 3, 4, 5]; ValueError for a malformed or descending range."""
    try:
        value = int(rng)
        return [value]
    except ValueError:
        pass
    parts = rng.split("-")
    if len(parts) != 2:
        raise ValueError(f"bad range: {rng!r}, expected N or N-M")
    start, end = int(parts[0]), int(parts[1])
    if start > end:
        raise ValueError(f"bad range: {rng!r}, start must not be greater than end")
    return list(range(start, end + 1))


def parse_range_list(range_str: str) -> list[int]:
    """``"0,2-4,7"`` -> [0, 2, 3, 4, 7]; ValueError if the ranges are not strictly ascending."""
    numbers: list[int] = []
    last = -1
    for rng in range_str.split(","):
        values = parse_range(rng)
        if values[0] <= last:
            raise ValueError(f"bad range list {range_str!r}: ranges must be ascending and not overlap")
        numbers.extend(values)
        last = values[-1]
    return numbers
