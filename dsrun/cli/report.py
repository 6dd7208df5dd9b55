"""Report the compiled ops (built, compatible, SIMD level or I/O engine, cache path) and the environment:
torch, Python, C++ compiler, accelerator and dsrun versions. Like DeepSpeed's ds_report."""
from __future__ import annotations

import argparse
import platform
import shutil
import sys

_OK = "[green][OKAY][/green]"
_NO = "[red][NO][/red]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-color", action="store_true", help="plain text, no colours")


def op_rows() -> list[tuple[str, str, str, str, str]]:
    """(op, built, compatible, SIMD / engine, where) for every op."""
    from op_builder import ALL_OPS, compiler

    rows = []
    for name, cls in ALL_OPS.items():
        builder = cls()
        ok, why = builder.is_compatible()
        if builder.prebuilt_available():
            built, where = f"{_OK} prebuilt", f"op_builder._prebuilt.{name}"
        else:
            library = builder.cached_library()
            built = f"{_OK} cached" if library else f"{_NO} (builds on first use)"
            where = str(library or builder.build_dir())
        if ok and not builder.is_built() and not compiler().ok:
            ok, why = False, "no working C++ compiler: the pure-torch fallback will be used"
        rows.append((name, built, _OK if ok else f"{_NO} {why}", builder.backend(), where))
    return rows


def environment_rows() -> list[tuple[str, str]]:
    import torch

    import dsrun
    from op_builder import cache_root, compiler, simd_level

    cxx = compiler()
    accel = "cpu"
    if torch.cuda.is_available():
        accel = f"cuda ({torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda})"
    return [
        ("dsrun", f"{dsrun.__version__} ({dsrun.__path__[0]})"),
        ("torch", f"{torch.__version__} ({torch.__path__[0]})"),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("C++ compiler", f"{cxx.command}: {cxx.version}" if cxx.ok else f"[red]unavailable[/red]: {cxx.version}"),
        ("ninja", shutil.which("ninja") or "[red]not found[/red] (pip install ninja)"),
        ("CPU SIMD level", simd_level()),
        ("accelerator", accel),
        ("torch threads", str(torch.get_num_threads())),
        ("op cache", str(cache_root())),
    ]


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(no_color=args.no_color, width=max(120, Console().width))
    if not getattr(args, "hide_operator_status", False):  # ds_report's flag (dsrun.cli.deepspeed_commands)
        ops = Table(title="dsrun compiled ops")
        for col in ("op", "built", "compatible", "SIMD / engine", "cache path"):
            ops.add_column(col, overflow="fold")
        for row in op_rows():
            ops.add_row(*row)
        console.print(ops)
    env = Table(title="environment", show_header=False)
    env.add_column("item")
    env.add_column("value", overflow="fold")
    for row in environment_rows():
        env.add_row(*row)
    console.print(env)
    return 0
