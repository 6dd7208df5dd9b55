"""Number formatting of DeepSpeed's flops profiler report, as its documented output shows it:
``336.23 M`` params, ``3139.93 GMACs``, ``6279.86 G`` flops, ``81.9 TFLOPS``, ``76.67 ms``.

Values are rounded to ``precision`` decimals and printed the way Python prints a float (``1.0``).
"""
from __future__ import annotations

DEFAULT_PRECISION = 2


def _scaled(value: float, units: list[tuple[float, str]], precision: int) -> str:
    for magnitude, unit in units:
        if abs(value) >= magnitude:
            return f"{round(value / magnitude, precision)} {unit}".rstrip()
    return f"{round(value, precision)}"


def params_to_string(params: float, precision: int = DEFAULT_PRECISION) -> str:
    """``1.05 M``, ``12.29 k``, ``512``."""
    return _scaled(params, [(1e6, "M"), (1e3, "k")], precision) if params >= 1e3 else str(int(params))


def macs_to_string(macs: float, precision: int = DEFAULT_PRECISION) -> str:
    """``3139.93 GMACs``, ``10.74 MMACs``, ``512 MACs`` (G is the largest unit, as DeepSpeed prints)."""
    if abs(macs) < 1e3:
        return f"{int(macs)} MACs"
    return _scaled(macs, [(1e9, "GMACs"), (1e6, "MMACs"), (1e3, "KMACs")], precision)


def number_to_string(num: float, precision: int = DEFAULT_PRECISION) -> str:
    """``6279.86 G``, ``1.5 M``, ``12.0`` (G is the largest unit)."""
    if abs(num) < 1e3:
        return f"{round(num, precision)}"
    return _scaled(num, [(1e9, "G"), (1e6, "M"), (1e3, "K")], precision)


def flops_to_string(flops_per_second: float, precision: int = DEFAULT_PRECISION) -> str:
    """``81.9 TFLOPS``, ``117.74 GFLOPS``, ``3.0 FLOPS``."""
    if abs(flops_per_second) < 1e3:
        return f"{round(flops_per_second, precision)} FLOPS"
    return _scaled(flops_per_second, [(1e12, "TFLOPS"), (1e9, "GFLOPS"), (1e6, "MFLOPS"), (1e3, "KFLOPS")],
                   precision)


def duration_to_string(seconds: float, precision: int = DEFAULT_PRECISION) -> str:
    """``1.89 s``, ``76.67 ms``, ``182.39 us``."""
    if abs(seconds) >= 1:
        return f"{round(seconds, precision)} s"
    if abs(seconds) >= 1e-3:
        return f"{round(seconds * 1e3, precision)} ms"
    return f"{round(seconds * 1e6, precision)} us"
