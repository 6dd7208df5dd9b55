"""`dsrun report` and `dsrun ops build` as a user runs them."""
from __future__ import annotations

import torch

import dsrun
from tests.helpers import run_cli


def test_report_lists_every_op_and_the_environment():
    proc = run_cli("report", "--no-color")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for op in ("cpu_adam", "cpu_adagrad", "cpu_lion", "async_io", "host_cache"):
        assert op in out
    for item in ("dsrun", "torch", "python", "C++ compiler", "accelerator", "op cache", "CPU SIMD level"):
        assert item in out
    assert torch.__version__ in out and dsrun.__version__ in out
    assert "[OKAY]" in out


def test_ops_build_builds_into_the_cache_and_reports_where():
    proc = run_cli("ops", "build", "cpu_adam", timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("cpu_adam: ") and ".so" in proc.stdout
    again = run_cli("ops", "build", "cpu_adam")
    assert again.returncode == 0 and "already built" in again.stdout


def test_ops_build_rejects_unknown_or_missing_names():
    proc = run_cli("ops", "build", "cpu_adma")
    assert proc.returncode == 2
    assert "did you mean 'cpu_adam'" in proc.stderr
    proc = run_cli("ops", "build")
    assert proc.returncode == 2 and "--all" in proc.stderr
